"""Image-text records for the Qwen-VL-style VLM tests: a tiny processor (byte-level BPE with the special tokens,
Qwen2-VL's image processor, a video processor) saved next to a checkpoint, records with images of two sizes, and
transformers' own batch and loss for them (the reference a first training step must equal)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def save_processor(out: Path, texts: list[str], *, family: str = "qwen2_5_vl") -> tuple[dict[str, int], int]:
    """A byte-level BPE tokenizer with Qwen-VL's special tokens, Qwen2-VL's image processor (4-pixel patches, a
    small pixel budget) and chat template, saved as the model directory's processor; returns (the special token
    ids, the vocabulary size)."""
    from loongforge_megatron.data.tokenizer import train_bpe
    from loongforge_megatron.models.qwen_vl.data import QWEN_VL_CHAT_TEMPLATE
    from transformers import (
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
        Qwen3VLProcessor,
    )

    tok = train_bpe(texts, vocab_size=290, out_dir=out)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|im_end|>"
    images = Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8,
                                   max_pixels=32 * 32)
    frames = dict(patch_size=4, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 8 * 8,
                                                                          "longest_edge": 32 * 32})
    video = Qwen2VLVideoProcessor(**frames)
    qwen3 = family.startswith("qwen3_vl")  # NOTE: Qwen3-VL-MoE's checkpoints ship Qwen3-VL's processor
    if qwen3:
        from transformers import Qwen3VLVideoProcessor

        video = Qwen3VLVideoProcessor(**frames)
    cls = Qwen3VLProcessor if qwen3 else Qwen2_5_VLProcessor
    processor = cls(image_processor=images, tokenizer=tok, video_processor=video, chat_template=QWEN_VL_CHAT_TEMPLATE)
    processor.save_pretrained(out)
    t = tok.convert_tokens_to_ids
    return {"image_token_id": t("<|image_pad|>"), "video_token_id": t("<|video_pad|>"),
            "vision_start_token_id": t("<|vision_start|>"), "vision_end_token_id": t("<|vision_end|>")}, len(tok)


def make_records(root: Path) -> Path:
    """Two records with images of different sizes: one ShareGPT-style, one OpenAI-style."""
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (24, 16), (200, 30, 30)).save(root / "red.png")
    g = torch.Generator().manual_seed(0)
    noise = (torch.rand(32, 16, 3, generator=g) * 255).to(torch.uint8).numpy()
    Image.fromarray(noise).save(root / "noise.png")
    records = [
        {"conversations": [{"from": "human", "value": "<image>\nWhat colour is this?"},
                           {"from": "gpt", "value": "It is red."}], "images": ["red.png"]},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "image", "image": "noise.png"},
                                                   {"type": "text", "text": "What is this?"}]},
                      {"role": "assistant", "content": "It is noise."},
                      {"role": "user", "content": "And the colour?"},
                      {"role": "assistant", "content": [{"type": "text", "text": "Green and blue."}]}]},
    ]
    (root / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root / "records.jsonl"


TEXTS = ["What colour is this? It is red. It is noise. Be brief. And the colour? Green and blue."] * 4


def hf_inputs(hf_dir: Path, records: Path) -> dict[str, torch.Tensor]:
    """What transformers' AutoProcessor makes of the records (processor-style messages), padded on the right, with
    labels on each assistant message's content and its <|im_end|>. A video is its frames at the record's fps
    (default 2), passed as frames already sampled."""
    from PIL import Image
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    processor = AutoProcessor.from_pretrained(hf_dir)
    tok = processor.tokenizer
    texts, images, videos, metadata, targets = [], [], [], [], []

    def add_video(ref):
        frames, fps = (ref["frames"], ref.get("fps", 2.0)) if isinstance(ref, dict) else (ref, 2.0)
        videos.append([Image.open(records.parent / f).convert("RGB") for f in frames])
        metadata.append(VideoMetadata(total_num_frames=len(frames), fps=float(fps),
                                      frames_indices=list(range(len(frames)))))

    for rec in map(json.loads, records.read_text().splitlines()):
        if "messages" in rec:
            msgs = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], list) else
                     [{"type": "text", "text": m["content"]}]} for m in rec["messages"]]
            for p in (p for m in msgs for p in m["content"]):
                if p["type"] == "image":
                    images.append(Image.open(records.parent / p["image"]).convert("RGB"))
                elif p["type"] == "video":
                    add_video(p["video"])
        else:
            role = {"human": "user", "gpt": "assistant"}
            msgs = []
            for t in rec["conversations"]:
                parts = [{"type": piece[1:-1]} if piece in ("<image>", "<video>") else {"type": "text", "text": piece}
                         for piece in re.split(r"(<image>|<video>)", t["value"]) if piece]
                msgs.append({"role": role[t["from"]], "content": parts})
            images += [Image.open(records.parent / r).convert("RGB") for r in rec.get("images", [])]
            for v in rec.get("videos", []):
                add_video(v)
        texts.append(processor.apply_chat_template(msgs, tokenize=False))
        targets.append([p["text"] for m in msgs if m["role"] == "assistant" for p in m["content"]])
    media = {"images": images or None}
    if videos:
        media.update(videos=videos, video_metadata=metadata, do_sample_frames=False)
    batch = processor(text=texts, **media, return_tensors="pt", padding=True, padding_side="right")
    batch = {k: v for k, v in batch.items() if k != "video_metadata"}
    labels = torch.full_like(batch["input_ids"], -100)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    start = tok.convert_tokens_to_ids("<|im_start|>")
    for row, answers in enumerate(targets):
        ids = batch["input_ids"][row].tolist()
        # NOTE: an assistant turn is "<|im_start|>assistant\n{content}<|im_end|>": label content + <|im_end|>
        head = tok("assistant\n", add_special_tokens=False)["input_ids"]
        found = 0
        for i in range(len(ids)):
            if ids[i] == start and ids[i + 1: i + 1 + len(head)] == head:
                j = i + 1 + len(head)
                k = ids.index(end, j)
                labels[row, j: k + 1] = batch["input_ids"][row, j: k + 1]
                found += 1
        assert found == len(answers)
    return {**batch, "labels": labels}


def hf_image_token(hf_dir: Path) -> int:
    return json.loads((hf_dir / "config.json").read_text())["image_token_id"]


def hf_loss(hf_dir: Path, batch: dict[str, torch.Tensor]) -> float:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**batch).loss.item()


def processor_loss(hf_dir: Path, records: Path, b: dict[str, torch.Tensor], *, pixels: str) -> float:
    """Transformers' loss on what its processor makes of ``records``, after checking that our micro-batch ``b`` (its
    rows padded) holds the processor's tokens and ``pixels`` patches."""
    ref_batch = hf_inputs(hf_dir, records)
    image = hf_image_token(hf_dir)
    # NOTE: the epoch order is seeded: rows are matched by their image token count (the images differ in size)
    mine = sorted(range(2), key=lambda r: int((b["tokens"][r] == image).sum()))
    theirs = sorted(range(2), key=lambda r: int((ref_batch["input_ids"][r] == image).sum()))
    for r, h in zip(mine, theirs, strict=True):
        n = int(ref_batch["attention_mask"][h].sum())
        assert b["tokens"][r, :n].tolist() == ref_batch["input_ids"][h, :n].tolist()
    assert torch.equal(torch.sort(b[pixels], 0)[0], torch.sort(ref_batch[pixels], 0)[0])
    return hf_loss(hf_dir, ref_batch)

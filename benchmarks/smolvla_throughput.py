"""SmolVLA training throughput on one GPU: LoongForge's embodied trainer (``lerobot_smolvla``: LeRobot's own
``VLAFlowMatching`` and processor steps) vs LeRobot 0.6.1's ``SmolVLAPolicy`` stepped the way ``lerobot-train``
steps it (named peer), at the published size, VLM frozen and the expert trained (LeRobot's defaults).

    python benchmarks/smolvla_throughput.py --batch 64 --steps 20                     # one GPU, synthetic frames
    python benchmarks/smolvla_throughput.py --batch 64 --data-root data/embodied/pusht512   # ours on a dataset
    python benchmarks/smolvla_throughput.py --smoke       # CPU, a tiny SmolVLM, 2 steps: checks the script itself

Both start from the same random init (one seed, the same construction) of SmolVLM2-500M-Video-Instruct's
architecture: ``--vlm DIR`` names its Hugging Face directory; without it a directory of its sizes is written by
transformers with a character-level tokenizer (no download; prompts are longer in characters than in SmolVLM's
BPE tokens). Ours: the job's step, data loading included (DataLoader workers, synthetic frames or ``--data-root``),
bf16 master-weight split as the recipe runs it. Peer (``lerobot_step``): the model step alone, ``SmolVLAPolicy``
under bf16 autocast (``lerobot_train.update_policy``) → backward → clip 10 → AdamW (SmolVLA's preset), on a batch its own
pre-processor made once and left on the GPU. Loss curves differ (each side draws its own data and noise); samples/s,
peak memory, ratio last. Rows go to ``benchmarks/results/smolvla_throughput.md`` (see ``harness.py``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
TASK = "Push the T-shaped block onto the target."
SEED = 0  # both sides build their random init under it
SPECIAL = {"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
           "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"}
# SmolVLM2-500M-Video-Instruct's architecture (its config.json's sizes), and a tiny one for --smoke
SIZES = {
    "smolvlm2-500m": ({"vocab_size": 49280, "hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32,
                       "num_attention_heads": 15, "num_key_value_heads": 5, "head_dim": 64, "rope_theta": 100000.0},
                      {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                       "image_size": 512, "patch_size": 16}, 4),
    "tiny": ({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16},
             {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 8}, 2),
}


def write_vlm(out: Path, sizes: str) -> None:
    """A SmolVLM directory of ``sizes`` saved by transformers: config + processor (character-level tokenizer
    with SmolVLM's special tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, SmolVLMConfig
    from transformers.models.smolvlm import SmolVLMImageProcessor, SmolVLMProcessor
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    text, vision, scale = SIZES[sizes]
    words = ["<unk>", "<|endoftext|>", "<|im_start|>", *SPECIAL.values(), "\n", *map(chr, range(32, 127))]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<|endoftext|>",
                                 bos_token="<|im_start|>", eos_token="<end_of_utterance>", extra_special_tokens=SPECIAL)
    SmolVLMConfig(text_config={"model_type": "llama", "vocab_size": len(vocab), **text}, vision_config=vision,
                  scale_factor=scale, image_token_id=vocab["<image>"]).save_pretrained(out)
    size = vision["image_size"]
    SmolVLMProcessor(image_processor=SmolVLMImageProcessor(max_image_size={"longest_edge": size},
                                                           size={"longest_edge": size}),
                     tokenizer=hf, video_processor=SmolVLMVideoProcessor(),
                     image_seq_len=(size // vision["patch_size"] // scale) ** 2).save_pretrained(out)


def _vlm(args) -> str:
    return args.vlm or str(Path(args.work) / "vlm")


def prepare(args, work: Path) -> None:
    if not args.vlm:
        write_vlm(work / "vlm", args.sizes)


def run_ours(args) -> dict:
    cuda = args.device == "cuda"
    over = [f"model.preset={args.preset}", f"model.arch.vlm={_vlm(args)}", "model.freeze=[vision,language]",
            f"model.arch.num_cameras={args.cameras}", f"train.steps={args.steps}", f"train.seed={SEED}",
            f"train.global_batch_size={args.batch}", f"train.micro_batch_size={args.batch}",
            f"train.precision={'bf16' if cuda else 'fp32'}", f"accelerator={args.device}", "train.lr=1e-4",
            "train.warmup_steps=0", "train.weight_decay=1e-10", "train.grad_clip=10.0",
            f"data.num_workers={args.workers}", f"data.synthetic_samples={args.batch * 16}", f"data.task={TASK}",
            "checkpoint.resume=never", "checkpoint.save_at_end=false", "logging.console=false",
            "logging.tensorboard=false"]
    if args.data_root:
        over += ["data.format=lerobot", f"data.root={args.data_root}"]
    return harness.run_job(ROOT / "recipes" / "embodied" / "lerobot_smolvla_tiny.yaml", over, steps=args.steps,
                           device=args.device, items=args.batch)


def run_lerobot(args) -> dict:
    import torch
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors
    from loongforge_embodied.policies.lerobot_smolvla.build import smolvla_config
    from loongforge_embodied.policies.lerobot_smolvla.configuration_lerobot_smolvla import PRESETS

    arch = PRESETS[args.preset].with_overrides(vlm=_vlm(args), num_cameras=args.cameras, state_dim=2, action_dim=2)
    config = smolvla_config(arch)
    config.freeze_vision_encoder = config.train_expert_only = True  # NOTE: LeRobot's defaults (ours: model.freeze)
    config.device = args.device
    torch.manual_seed(SEED)
    policy = SmolVLAPolicy(config).to(args.device).train()
    stats = {"observation.state": {"mean": torch.zeros(2), "std": torch.ones(2)},
             "action": {"mean": torch.zeros(2), "std": torch.ones(2)}}
    pre, _ = make_smolvla_pre_post_processors(config, dataset_stats=stats)
    g = torch.Generator().manual_seed(0)
    frames = {k: torch.rand(args.batch, 3, arch.image_size, arch.image_size, generator=g) for k in config.image_features}
    batch = pre({**frames, "observation.state": torch.randn(args.batch, 2, generator=g),
                 "action": torch.randn(args.batch, arch.chunk_size, 2, generator=g),
                 "action_is_pad": torch.zeros(args.batch, arch.chunk_size, dtype=torch.bool),
                 "task": [TASK] * args.batch})
    step, params = harness.lerobot_step(policy, batch, device=args.device)
    start = harness.init_sum(params)
    res = harness.time_steps(step, steps=args.steps, device=args.device)
    return {**res, "items": args.batch, "trainable_m": sum(p.numel() for p in params) / 1e6, "init_sum": start}


VARIANTS = {"loongforge": run_ours, "lerobot_step": run_lerobot}

BENCH = harness.Bench(name="smolvla_throughput", script=__file__, variants=VARIANTS, unit="samples/s",
                      pairs=[("loongforge", "lerobot_step")],
                      columns={"trainable M": lambda r: f"{r.get('trainable_m', 0):.1f}"})


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smolvla", help="lerobot_smolvla's preset")
    p.add_argument("--sizes", default="smolvlm2-500m", choices=list(SIZES), help="the VLM written without --vlm")
    p.add_argument("--vlm", default=None, help="a SmolVLM directory (config + processor) instead")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--cameras", type=int, default=1)
    p.add_argument("--workers", type=int, default=8, help="ours: DataLoader workers")
    p.add_argument("--data-root", default=None, help="ours: a LeRobotDataset v3 instead of synthetic frames")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    harness.add_args(p, variants=VARIANTS, default="loongforge,lerobot_step")
    args = harness.parse(p, argv, steps=20, warmup=5, smoke={
        "preset": "tiny", "sizes": "tiny", "batch": 2, "workers": 0, "device": "cpu"})
    setup = (f"SmolVLA {args.preset} ({args.vlm or args.sizes}), batch {args.batch}, {args.cameras} camera(s), "
             f"{'bf16' if args.device == 'cuda' else 'fp32'}, VLM frozen, "
             f"{'data ' + args.data_root if args.data_root else 'synthetic frames'}")
    return BENCH.main(args, setup=setup, device=args.device, prepare=prepare)


if __name__ == "__main__":
    main()

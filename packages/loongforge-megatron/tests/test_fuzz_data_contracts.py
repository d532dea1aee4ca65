"""Generated bad input on the megatron backend's data surfaces, each held to the CLI's contract: a one-line
``LoongForgeError`` (exit 2 through the CLI) naming the file (and record / key), never a traceback, never a hang.

Conversations records (their schema, the image / frame files they name), video clip folders of a latent cache
(frames + caption), FP8 policy files (``train.fp8.policy``)
and recipe values that can only fail later. Records are read by the dataset itself with a tiny Qwen3-VL processor;
policy files by the reader ``validate`` uses (a few through ``validate`` itself); recipe values through ``validate``.
"""

from __future__ import annotations

import copy
import json
import os
import random
import struct
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[3]
LLM = ROOT / "recipes" / "llm" / "tiny" / "llama_tiny.yaml"
VLM = ROOT / "recipes" / "vlm" / "qwen2_5_vl_tiny.yaml"
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

pytestmark = pytest.mark.timeout(120)  # NOTE: a case that hangs fails here (the first one builds the processor)


def one_line(err: BaseException, *named: str) -> str:
    """The error's message, checked to be one line naming each of ``named``."""
    from loongforge.errors import LoongForgeError

    msg = str(err)
    assert isinstance(err, LoongForgeError), f"{type(err).__name__}: {msg[:500]}"
    assert "\n" not in msg and "Traceback" not in msg, msg[:2000]
    for n in named:
        assert n in msg, (n, msg)
    return msg


# ---- conversations records ------------------------------------------------------------------------------------------

def _png(path: Path, w: int, h: int) -> None:
    """A PNG whose header says ``w`` x ``h`` (its pixel data is a few bytes: the header is what must be checked)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def convo(tmp_path_factory):
    """(records folder with good images and frames, processor, a Qwen3-VL-like arch)."""
    from loongforge_megatron.data.tokenizer import train_bpe
    from loongforge_megatron.models.qwen_vl.data import QWEN_VL_CHAT_TEMPLATE
    from PIL import Image
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    base = tmp_path_factory.mktemp("convo")
    out = base / "hf"
    tok = train_bpe(["What colour is this? It is red. Be brief."] * 4, vocab_size=290, out_dir=out)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|im_end|>"
    frames = dict(patch_size=4, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 64, "longest_edge": 1024})
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2,
                                                                       min_pixels=64, max_pixels=1024),
                                 tokenizer=tok, video_processor=Qwen3VLVideoProcessor(**frames),
                                 chat_template=QWEN_VL_CHAT_TEMPLATE)
    t = tok.convert_tokens_to_ids
    arch = SimpleNamespace(spec_name="qwen3_vl", vision={
        "image_token_id": t("<|image_pad|>"), "video_token_id": t("<|video_pad|>"),
        "vision_config": {"spatial_merge_size": 2, "tokens_per_second": 2}})
    data = base / "data"
    (data / "sub").mkdir(parents=True)
    for name in ("red.png", "f1.png", "f2.png", "sub/blue.png"):
        Image.new("RGB", (24, 16), (200, 30, 30)).save(data / name)
    outside = base / "outside.png"
    Image.new("RGB", (24, 16), (0, 0, 0)).save(outside)
    (data / "out.png").symlink_to(outside)  # NOTE: a symlink out of the records' folder
    (data / "root").symlink_to("/")  # a subfolder linked to /
    (data / "loop.png").symlink_to("loop.png")
    (data / "dir.png").mkdir()
    os.mkfifo(data / "fifo.png")
    (data / "zero.png").symlink_to("/dev/zero")
    _png(data / "bomb.png", 100_000, 100_000)
    _png(data / "big.png", 20_000, 20_000)  # 400 megapixels
    _png(data / "thin.png", 4000, 4)
    _png(data / "zero_w.png", 0, 16)
    (data / "text.png").write_text("not an image")
    (data / "trunc.png").write_bytes((data / "red.png").read_bytes()[:40])
    return data, processor, arch


def _dataset(convo, records: list, *, raw: bytes | None = None, **kw):
    from loongforge_megatron.models.qwen_vl.data import Conversations

    data, processor, arch = convo
    path = data / f"r{random.random():.12f}.jsonl"
    path.write_bytes(raw if raw is not None else "".join(json.dumps(r) + "\n" for r in records).encode())
    return path, lambda: Conversations(str(path), processor=processor, arch=arch, seq_length=256, seed=0, pack=True,
                                       **kw)


SHAREGPT = {"conversations": [{"from": "human", "value": "<image>\nWhat colour is this?"},
                              {"from": "gpt", "value": "It is red."}], "images": ["red.png"]}
OPENAI = {"messages": [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": [{"type": "image", "image": "red.png"},
                                                    {"type": "video", "video": {"frames": ["f1.png", "f2.png"],
                                                                                "fps": 2}},
                                                    {"type": "text", "text": "What is this?"}]},
                       {"role": "assistant", "content": "It is red."}]}
PATHS = {
    "sharegpt": [("conversations",), ("conversations", 0), ("conversations", 0, "from"), ("conversations", 0, "value"),
                 ("conversations", 1, "from"), ("images",), ("images", 0)],
    "openai": [("messages",), ("messages", 1), ("messages", 1, "role"), ("messages", 1, "content"),
               ("messages", 1, "content", 0), ("messages", 1, "content", 0, "type"), ("messages", 1, "content", 0, "image"),
               ("messages", 1, "content", 1, "video"), ("messages", 1, "content", 1, "video", "fps"),
               ("messages", 1, "content", 1, "video", "frames")],
}
VALUES = [None, True, 0, -1, 1e308, "", "zz", [], {}, ["user"], {"a": [1]}, float("nan"), float("inf")]


def _mutated(style: str, path: tuple, value) -> dict:
    rec = copy.deepcopy(SHAREGPT if style == "sharegpt" else OPENAI)
    node = rec
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return rec


MUTATIONS = [(s, p, v) for s, paths in PATHS.items() for p in paths for v in VALUES]


@pytest.mark.parametrize(("style", "path", "value"), MUTATIONS,
                         ids=[f"{s}-{'.'.join(map(str, p))}={str(v)[:12]}" for s, p, v in MUTATIONS])
def test_mutated_record_is_read_or_one_line(convo, style, path, value):
    from loongforge.errors import LoongForgeError

    file, make = _dataset(convo, [_mutated(style, path, value)])
    try:
        ds = make()
        ds.encode(0)
    except LoongForgeError as exc:
        one_line(exc, str(file), "record 1")


def _deep(n: int) -> bytes:
    return ('{"messages": ' + "[" * n + "]" * n + "}\n").encode()


def _turns(n: int) -> dict:
    turns = [{"from": "human" if i % 2 == 0 else "gpt", "value": f"turn {i}"} for i in range(n)]
    return {"conversations": turns}


def _video(frames, fps=2) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "video", "video": {"frames": frames, "fps": fps}}]},
                         {"role": "assistant", "content": "ok"}]}


def _image(ref: str) -> dict:
    return {**SHAREGPT, "images": [ref]}


RECORDS = {  # case -> (records or raw bytes, what the error names)
    "json nested 100k deep": (_deep(100_000), "nests deeper"),
    "json nested 200 deep": (_deep(200), "nests deeper"),
    "2000 turns": ([_turns(2000)], "turns"),
    "20000 turns": ([_turns(20000)], "turns"),
    "role a list": ([{"messages": [{"role": ["user"], "content": "x"}, {"role": "assistant", "content": "y"}]}],
                    "role"),
    "from a dict": ([{"conversations": [{"from": {"x": 1}, "value": "x"}]}], "from"),
    "no assistant turn": ([{"conversations": [{"from": "human", "value": "hello"}]}], "no assistant turn"),
    "system only": ([{"messages": [{"role": "system", "content": "Be brief."}]}], "no assistant turn"),
    "fps nan": ([_video(["f1.png", "f2.png"], float("nan"))], "fps"),
    "fps inf": ([_video(["f1.png", "f2.png"], float("inf"))], "fps"),
    "fps -inf": ([_video(["f1.png", "f2.png"], float("-inf"))], "fps"),
    "fps negative": ([_video(["f1.png", "f2.png"], -2)], "fps"),
    "fps string": ([_video(["f1.png", "f2.png"], "2")], "fps"),
    "fps bool": ([_video(["f1.png", "f2.png"], True)], "fps"),
    "one-frame video": ([_video(["f1.png"])], "temporal patch"),
    "symlinked image out of the folder": ([_image("out.png")], "outside the records' folder"),
    "image through a subfolder linked to /": ([_image("root/etc/hostname")], "outside the records' folder"),
    "frame through a subfolder linked to /": ([_video(["root/etc/hostname", "f1.png"])], "outside the records"),
    "symlink loop": ([_image("loop.png")], "loop.png"),
    "absolute path": ([_image("/etc/hostname")], "not a path inside"),
    "dotdot path": ([_image("../outside.png")], "not a path inside"),
    "nul in path": ([_image("red.png\u0000x")], "not a path inside"),
    "directory as image": ([_image("dir.png")], "not a regular file"),
    "fifo as image": ([_image("fifo.png")], "fifo.png"),
    "dev zero as image": ([_image("zero.png")], "zero.png"),
    "100000 x 100000 png header": ([_image("bomb.png")], "bomb.png"),
    "400 megapixels": ([_image("big.png")], "max_image_pixels"),
    "aspect ratio 1000": ([_image("thin.png")], "aspect ratio"),
    "zero width": ([_image("zero_w.png")], "zero_w.png"),
    "not an image": ([_image("text.png")], "unreadable"),
    "truncated png": ([_image("trunc.png")], "trunc.png"),
    "missing image": ([_image("gone.png")], "not found"),
    "2000 images": ([{"conversations": [{"from": "human", "value": "<image>" * 2000}, {"from": "gpt", "value": "x"}],
                      "images": ["red.png"] * 2000}], "images"),
    "huge text": ([{"conversations": [{"from": "human", "value": "a" * 1_100_000}, {"from": "gpt", "value": "x"}]}],
                  "characters"),
    "non-utf8 file": (b'{"conversations": "\xff\xfe"}\n', "UTF-8"),
    "binary file": (random.Random(0).randbytes(2000), None),
    "empty file": (b"", "no records"),
    "list of scalars": (b"[1, 2, 3]", "record 1"),
    "top-level object": (b'{"messages": "x"}', "record 1"),
    "garbled line": (b'{"messages": [\n', "line 1"),
    "NaN literal fps": (b'{"messages": [{"role": "user", "content": [{"type": "video", "video": {"frames": '
                        b'["f1.png", "f2.png"], "fps": NaN}}]}, {"role": "assistant", "content": "ok"}]}\n', "fps"),
}


@pytest.mark.parametrize("case", sorted(RECORDS))
def test_hostile_record_is_one_line(convo, case):
    from loongforge.errors import LoongForgeError

    records, named = RECORDS[case]
    raw = records if isinstance(records, bytes) else None
    file, make = _dataset(convo, [] if raw is not None else records, raw=raw)
    with pytest.raises(LoongForgeError) as err:
        make().encode(0)
    one_line(err.value, str(file), *([named] if named else []))


def test_unsupervised_records_are_counted_and_skipped_when_asked(convo, capsys):
    from loongforge.errors import LoongForgeError

    system = {"messages": [{"role": "system", "content": "Be brief."}]}
    _, make = _dataset(convo, [system, SHAREGPT, {"conversations": [{"from": "human", "value": "hi"}]}],
                       skip_unsupervised=True)
    ds = make()
    assert len(ds.records) == 1 and sum(ds.encode(0)["mask"]) > 0
    assert "2 of 3 records have no assistant turn" in capsys.readouterr().err
    file, make = _dataset(convo, [system], skip_unsupervised=True)
    with pytest.raises(LoongForgeError) as err:
        make()
    one_line(err.value, str(file), "none of its 1 records")


def test_intact_records_encode(convo):
    _, make = _dataset(convo, [SHAREGPT, OPENAI])
    ds = make()
    for n in range(2):
        rec = ds.encode(n)
        assert sum(rec["mask"]) > 0 and rec["image_grid_thw"].shape[0] == 1


# ---- FP8 policy files (train.fp8.policy) ------------------------------------------------------------------------------

# ---- video clip folders (frames + caption) of a latent cache ------------------------------------------------------

def _frame(path: Path, w: int = 16, h: int = 16) -> None:
    from PIL import Image

    Image.new("RGB", (w, h), (200, 10, 10)).save(path)


def _clip_good(folder: Path) -> None:
    for i in range(5):
        _frame(folder / f"{i:03d}.png")
    (folder / "caption.txt").write_text("a red square")


def _clip_case(folder: Path, case: str) -> str:
    """Make clip folder ``case`` (one defect on a good clip); return the path the error must name."""
    _clip_good(folder)
    first, cap = folder / "000.png", folder / "caption.txt"
    if case == "no frames":
        for p in folder.glob("*.png"):
            p.unlink()
        return str(folder)
    if case == "frame count 4":
        (folder / "004.png").unlink()
        return str(folder)
    if case == "mixed sizes":
        _frame(folder / "003.png", 32, 16)
        return str(folder / "003.png")
    if case == "size not a multiple":
        for i in range(5):
            _frame(folder / f"{i:03d}.png", 24, 16)
        return str(first)
    if case == "truncated png":
        first.write_bytes(first.read_bytes()[:40])
    elif case == "text as png":
        first.write_text("not an image")
    elif case == "header only png":
        _png(first, 16, 16)
    elif case == "png is a folder":
        first.unlink()
        first.mkdir()
    elif case == "png links to /dev/zero":
        first.unlink()
        first.symlink_to("/dev/zero")
    elif case == "png link loop":
        first.unlink()
        first.symlink_to(first.name)
    elif case == "binary png":
        first.write_bytes(random.Random(0).randbytes(500))
    else:
        if case == "no caption":
            cap.unlink()
            return str(folder)
        if case == "empty caption":
            cap.write_text("  \n")
        elif case == "non-utf8 caption":
            cap.write_bytes(b"caption \xff\xfe")
        elif case == "NUL in caption":
            cap.write_bytes(b"a\0b")
        elif case == "caption is a folder":
            cap.unlink()
            cap.mkdir()
        elif case == "caption links to /dev/zero":
            cap.unlink()
            cap.symlink_to("/dev/zero")
        return str(cap)
    return str(first)


CLIP_CASES = ["no frames", "frame count 4", "mixed sizes", "size not a multiple", "truncated png", "text as png",
              "header only png", "png is a folder", "png links to /dev/zero", "png link loop", "binary png",
              "no caption", "empty caption", "non-utf8 caption", "NUL in caption", "caption is a folder",
              "caption links to /dev/zero"]


@pytest.mark.parametrize("case", CLIP_CASES)
def test_bad_clip_folder_is_one_line(tmp_path, case):
    """A latent cache's clip folder with one defect is refused in one line naming the folder / file."""
    from loongforge_megatron.models.wan.cache import read_clip

    folder = tmp_path / "clip"
    folder.mkdir()
    named = _clip_case(folder, case)
    with pytest.raises(Exception) as err:
        read_clip(folder, temporal=4, multiple=16)
    one_line(err.value, named, "data.frames")


def test_intact_clip_folder_reads(tmp_path):
    from loongforge_megatron.models.wan.cache import read_clip

    _clip_good(tmp_path)
    video, caption = read_clip(tmp_path, temporal=4, multiple=16)
    assert video.shape == (3, 5, 16, 16) and caption == "a red square"
    assert float(video[0].min()) > 0.5 and float(video[1].max()) < -0.5  # red, scaled to [-1, 1]


GOOD_POLICY = {"version": 1, "device": "x", "recipe": "tensorwise", "gemms": {
    "128x192x64": {"name": "qkv", "fwd": {"bf16_ms": 0.1, "fp8_ms": 0.05, "fp8_faster": True},
                   "dgrad": {"bf16_ms": 0.1, "fp8_ms": 0.2, "fp8_faster": False},
                   "wgrad": {"bf16_ms": 0.1, "fp8_ms": None, "fp8_faster": False}},
    "experts4:256x64x32": {"name": "expert_fc1", "fwd": {"fp8_faster": True}, "dgrad": {"fp8_faster": False},
                           "wgrad": {"fp8_faster": False}}}}
POLICY_PATHS = [("gemms",), ("gemms", "128x192x64"), ("gemms", "128x192x64", "fwd"),
                ("gemms", "128x192x64", "fwd", "fp8_faster"), ("gemms", "experts4:256x64x32", "wgrad")]
POLICY_VALUES = [None, 1, "yes", [1, 2], {}, 0.5, {"fp8_faster": 1}]


def _policy_mutations() -> dict[str, bytes]:
    cases: dict[str, bytes] = {}
    for path in POLICY_PATHS:
        for value in POLICY_VALUES:
            p = copy.deepcopy(GOOD_POLICY)
            node = p
            for k in path[:-1]:
                node = node[k]
            node[path[-1]] = value
            cases[f"{'.'.join(path)}={json.dumps(value)}"] = json.dumps(p).encode()
    good = json.dumps(GOOD_POLICY).encode()
    for key in ("12x3", "0x1x1", "ax1x1", "experts0:1x1x1", "1x1x1x1", ""):
        cases[f"key {key!r}"] = json.dumps({"gemms": {key: GOOD_POLICY["gemms"]["128x192x64"]}}).encode()
    for frac in (0.1, 0.5, 0.9):
        cases[f"truncated {frac}"] = good[: int(len(good) * frac)]
    for seed in range(3):
        cases[f"binary {seed}"] = random.Random(seed).randbytes(300)
    cases.update({"gemms a list": b'{"gemms": [1, 2]}', "list root": b"[]", "scalar root": b"3", "empty": b"",
                  "deep": b"[" * 100_000 + b"]" * 100_000, "deep object": b'{"gemms": ' + b'{"a": ' * 500 + b"1"
                  + b"}" * 501, "non-utf8": b'{"gemms": "\xff"}', "nan": b'{"gemms": NaN}'})
    return cases


POLICIES = _policy_mutations()


@pytest.mark.parametrize("case", sorted(POLICIES))
def test_bad_policy_file_is_read_or_one_line(tmp_path, case):
    """A mutated entry may still be a policy (``{}`` for a GEMM: not faster in FP8); anything else is refused."""
    from loongforge.errors import LoongForgeError
    from loongforge_megatron.fp8_policy import load_policy

    path = tmp_path / "policy.json"
    path.write_bytes(POLICIES[case])
    try:
        policy = load_policy(path)
    except LoongForgeError as exc:
        one_line(exc, str(path), "train.fp8.policy")
        return
    assert "=" in case and isinstance(policy["gemms"], dict), case


def test_intact_policy_file_loads(tmp_path):
    from loongforge_megatron.fp8_policy import load_policy

    (tmp_path / "p.json").write_text(json.dumps(GOOD_POLICY))
    assert load_policy(tmp_path / "p.json")["gemms"].keys() == GOOD_POLICY["gemms"].keys()


def cli(capsys, *argv: str) -> tuple[int, list[str]]:
    from loongforge.cli import main

    rc = main(list(argv))
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def assert_contract(rc: int, lines: list[str], *named: str) -> None:
    text = "\n".join(lines)
    assert "Traceback" not in text and "internal error" not in text, text[-2000:]
    errors = [line for line in lines if line.startswith("error: ")]
    assert rc == 2 and len(errors) == 1, (rc, text[-2000:])
    for n in named:
        assert n in errors[0], (n, errors[0])


def _special_policy(tmp_path: Path, kind: str) -> str:
    if kind == "/dev/zero":
        return "/dev/zero"
    path = tmp_path / "policy"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(64 * 2**20)  # NOTE: sparse: 64 MiB on paper, nothing on disk
    elif kind == "missing":
        pass
    else:
        path.write_bytes({"deep": b"[" * 100_000 + b"]" * 100_000, "gemms list": b'{"gemms": [1, 2]}'}[kind])
    return str(path)


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", "directory", "huge", "missing", "deep", "gemms list"])
def test_bad_policy_file_is_refused_at_validate(tmp_path, capsys, kind):
    path = _special_policy(tmp_path, kind)
    rc, lines = cli(capsys, "validate", str(LLM), f"train.fp8.policy={path}")
    assert_contract(rc, lines, path, "train.fp8.policy")


# ---- recipe values that would only fail later ------------------------------------------------------------------------

BOOL_AS_COUNT = ["train.steps", "train.global_batch_size", "train.micro_batch_size", "train.eval_steps", "train.seed",
                 "data.num_workers", "data.seq_length", "checkpoint.save_interval", "checkpoint.keep_last",
                 "logging.interval", "parallel.tp", "model.num_layers", "model.hidden_size", "train.lr",
                 "train.warmup_steps"]
RECIPE_VALUES = (
    [(LLM, f"{k}={v}", k) for k in BOOL_AS_COUNT for v in ("true", "false")]
    + [(LLM, o, o.partition("=")[0]) for o in (
        "data.num_workers=1000000", "data.num_workers=-1", "train.eval_steps=1000000000", "train.eval_steps=0",
        "train.freeze=[vision]", "train.freeze=[projector]", "train.freeze=['*']", "train.freeze=['**']",
        "train.freeze=['decoder.layers.9.*']", "train.freeze=['vision.*']", "train.freeze=['encoder.layers.?.*']",
        "data.pack=true", "data.pack=false", "data.max_image_pixels=100", "data.skip_unsupervised=true")]
    + [(VLM, o, o.partition("=")[0]) for o in (
        "train.freeze=[vision,language]", "train.freeze=[vision,projector,language]", "train.freeze=[visoin]",
        "train.freeze=['*']", "train.freeze=['language_model.*']", "data.max_image_pixels=0", "data.max_image_pixels=true",
        "data.max_image_pixels=1000000000000")]
)


@pytest.mark.parametrize(("recipe", "override", "key"), RECIPE_VALUES,
                         ids=[f"{r.stem}-{o[:40]}" for r, o, _ in RECIPE_VALUES])
def test_recipe_value_that_fails_later_is_refused_at_validate(capsys, recipe, override, key):
    rc, lines = cli(capsys, "validate", str(recipe), override)
    assert_contract(rc, lines, key.rsplit(".", 1)[-1])

"""Wan's latent cache: ``loongforge data prepare`` on generated clip folders (PNG frames + captions) through a
tiny diffusers-saved ``AutoencoderKLWan`` and a tiny transformers-saved UMT5 encoder; the cached latent videos
decode to what the autoencoder's own encode -> decode of the same frames gives, the cached text is the encoder's
hidden states of the caption (zeros after it), and the tiny recipe trains on the cache (clips of two sizes,
packed). An image-to-video model's cache holds the condition and image tokens diffusers' I2V pipeline makes.

NOTE: the megatron job runs in a rank (``ranks``), never in pytest's own process."""

from __future__ import annotations

from pathlib import Path

import loongforge
import pytest
import torch
from loongforge.cli import main

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "diffusion" / "wan_tiny.yaml"
CHANNELS, TEXT_DIM, TEXT_LENGTH = 16, 32, 12  # the wan-tiny preset's latent channels and text width
IMAGE_DIM = 24  # the tiny CLIP vision tower's width (5 tokens: 2 x 2 patches + class)
# NOTE: an image-to-video wan-tiny: noisy latent + first-frame mask (4) + first-frame latent, image tokens
I2V = ["model.in_channels=36", f"model.image_dim={IMAGE_DIM}", "model.added_kv_proj_dim=64", "data.image_tokens=5"]
CLIPS = {"a_walk": ((5, 32, 32), "a dog walks on the beach"), "b_still": ((1, 16, 32), "a red car")}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Clip folders of random frames with captions, a tiny AutoencoderKLWan and a tiny UMT5 encoder + tokenizer."""
    from diffusers import AutoencoderKLWan
    from loongforge_megatron.data.tokenizer import train_bpe
    from PIL import Image
    from transformers import UMT5Config, UMT5EncoderModel

    root = tmp_path_factory.mktemp("wan_cache")
    g = torch.Generator().manual_seed(0)
    for name, ((frames, h, w), caption) in CLIPS.items():
        folder = root / "frames" / name
        folder.mkdir(parents=True)
        for i in range(frames):
            pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)
            Image.fromarray(pixels.numpy()).save(folder / f"{i:03d}.png")
        (folder / "caption.txt").write_text(caption + "\n")
    torch.manual_seed(0)
    ae = AutoencoderKLWan(base_dim=8, z_dim=CHANNELS, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
                          latents_mean=[0.1 * i for i in range(CHANNELS)],
                          latents_std=[1.0 + 0.1 * i for i in range(CHANNELS)])
    ae.save_pretrained(root / "autoencoder")
    text = root / "text_encoder"
    tok = train_bpe([c for _, c in CLIPS.values()] * 4, vocab_size=300, out_dir=text)
    UMT5EncoderModel(UMT5Config(vocab_size=len(tok), d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                relative_attention_num_buckets=8)).save_pretrained(text)
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    image = root / "image_encoder"
    CLIPVisionModel(CLIPVisionConfig(hidden_size=IMAGE_DIM, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, image_size=32, patch_size=16)).save_pretrained(image)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(image)
    return {"frames": root / "frames", "autoencoder": root / "autoencoder", "text_encoder": text,
            "image_encoder": image, "cache": root / "cache"}


def keys(sources: dict[str, Path]) -> list[str]:
    return ["data.format=latent_cache", f"data.path={sources['cache']}", f"data.frames={sources['frames']}",
            f"data.autoencoder={sources['autoencoder']}", f"data.text_encoder={sources['text_encoder']}",
            f"data.text_length={TEXT_LENGTH}"]


def _train_on_cache(*, rank, world, tmp_path, overrides):
    recipe = loongforge.load_recipe(RECIPE, ["accelerator=cpu", "logging.console=false", "train.steps=2",
                                             "train.warmup_steps=0", "train.global_batch_size=2", "train.micro_batch_size=2", *overrides])
    job, runtime = loongforge.build_job(recipe, output_dir=tmp_path / "run")
    try:
        batch = job.schedule.microbatches(0, device=torch.device("cpu"))[0]
        return [job.step()["loss"] for _ in range(2)], batch["grid"].tolist()
    finally:
        job.close()
        runtime.logger.close()


def test_prepared_cache_decodes_like_the_autoencoder_and_trains(tmp_path, ranks, sources, capsys):
    from diffusers import AutoencoderKLWan
    from loongforge_megatron.models.wan.cache import Encoders, read_clip
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, UMT5EncoderModel

    assert main(["data", "prepare", str(RECIPE), *keys(sources)]) == 0
    assert f"prepared: {sources['cache']}" in capsys.readouterr().out
    enc = Encoders(autoencoder=str(sources["autoencoder"]), text_encoder=str(sources["text_encoder"]),
                   text_length=TEXT_LENGTH)
    ae = AutoencoderKLWan.from_pretrained(sources["autoencoder"]).eval()
    t5 = UMT5EncoderModel.from_pretrained(sources["text_encoder"]).eval()
    tok = AutoTokenizer.from_pretrained(sources["text_encoder"])
    for name, ((frames, h, w), caption) in CLIPS.items():
        stored = load_file(sources["cache"] / "clips" / f"{name}.safetensors")
        assert stored["x0"].shape == (CHANNELS, (frames - 1) // 4 + 1, h // 8, w // 8), name
        video, _ = read_clip(sources["frames"] / name, temporal=4, multiple=16)
        with torch.no_grad():
            want = ae.decode(ae.encode(video[None]).latent_dist.mode()).sample[0]
        torch.testing.assert_close(enc.decode_video(stored["x0"]), want, rtol=1e-5, atol=1e-5)
        ids = tok(caption, return_tensors="pt").input_ids
        with torch.no_grad():
            hidden = t5(ids).last_hidden_state[0]
        n = ids.shape[1]
        torch.testing.assert_close(stored["text"][:n], hidden, rtol=1e-5, atol=1e-5)
        assert not stored["text"][n:].any()
    # a second prepare finds the cache complete
    assert main(["data", "prepare", str(RECIPE), *keys(sources)]) == 0
    losses, grids = ranks(_train_on_cache, world=1, out=tmp_path / "one", tmp_path=tmp_path,
                          overrides=keys(sources))[0]
    assert sorted(map(tuple, grids)) == [(1, 1, 2), (2, 2, 2)]  # both clips, packed in one micro-batch
    assert all(torch.isfinite(torch.tensor(losses))) and losses[0] != losses[1]


def test_image_to_video_cache_holds_the_pipelines_condition_and_image_tokens_and_trains(tmp_path, ranks, sources,
                                                                                        capsys):
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
    from loongforge_megatron.models.wan.cache import read_clip
    from PIL import Image
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPVisionModel, UMT5EncoderModel

    cache = tmp_path / "i2v_cache"
    over = [k for k in keys(sources) if not k.startswith("data.path=")]
    over += [f"data.path={cache}", f"data.image_encoder={sources['image_encoder']}", *I2V]
    assert main(["data", "prepare", str(RECIPE), *over]) == 0
    capsys.readouterr()
    pipe = WanImageToVideoPipeline(
        tokenizer=AutoTokenizer.from_pretrained(sources["text_encoder"]),
        text_encoder=UMT5EncoderModel.from_pretrained(sources["text_encoder"]),
        vae=AutoencoderKLWan.from_pretrained(sources["autoencoder"]).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        image_processor=CLIPImageProcessor.from_pretrained(sources["image_encoder"]),
        image_encoder=CLIPVisionModel.from_pretrained(sources["image_encoder"]).eval())
    for name, ((frames, h, w), _) in CLIPS.items():
        stored = load_file(cache / "clips" / f"{name}.safetensors")
        video, _ = read_clip(sources["frames"] / name, temporal=4, multiple=16)
        with torch.no_grad():
            _, condition = pipe.prepare_latents(video[:, 0][None], 1, CHANNELS, h, w, frames, dtype=torch.float32,
                                                device=torch.device("cpu"))
            first = Image.open(sources["frames"] / name / "000.png").convert("RGB")
            image = pipe.encode_image(first, device=torch.device("cpu"))
        torch.testing.assert_close(stored["condition"], condition[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stored["image"], image[0], rtol=1e-5, atol=1e-5)
    losses, grids = ranks(_train_on_cache, world=1, out=tmp_path / "one", tmp_path=tmp_path, overrides=over)[0]
    assert sorted(map(tuple, grids)) == [(1, 1, 2), (2, 2, 2)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[0] != losses[1]
    # the text-to-video model refuses the image-to-video cache, naming data.path
    err = ranks(_refusal, world=1, out=tmp_path / "t2v", tmp_path=tmp_path,
                overrides=[*keys(sources)[:1], f"data.path={cache}"])[0]
    assert "data.path" in err and "prepare --force" in err and "\n" not in err, err


def _refusal(*, rank, world, tmp_path, overrides):
    from loongforge.errors import RecipeError

    try:
        _train_on_cache(rank=rank, world=world, tmp_path=tmp_path, overrides=overrides)
    except RecipeError as exc:
        return f"{exc.key}: {exc}"
    return "no error"


def _write_video(path: Path, frames: list, *, codec: str = "libx264rgb") -> None:
    """``frames`` (uint8 [H, W, 3]) as a video file through PyAV; libx264rgb at qp 0 is lossless."""
    import av

    h, w = frames[0].shape[:2]
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=8)
        stream.width, stream.height, stream.pix_fmt = w, h, "rgb24"
        stream.options = {"qp": "0"}
        for pixels in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels.numpy(), format="rgb24")))
        container.mux(stream.encode())


def test_video_files_cache_like_the_same_frames_as_a_folder(tmp_path, ranks, sources, capsys):
    """A clip as an mp4 (7 frames: its first 5 are the clip) gives the latents and text of the same 5 frames as PNGs
    in a folder; a damaged or missing video / caption stops data prepare with one line naming the file."""
    from PIL import Image
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(1)
    frames = [torch.randint(0, 256, (16, 32, 3), generator=g, dtype=torch.uint8) for _ in range(7)]
    root = tmp_path / "frames"
    (root / "as_pngs").mkdir(parents=True)
    for i, pixels in enumerate(frames[:5]):
        Image.fromarray(pixels.numpy()).save(root / "as_pngs" / f"{i:03d}.png")
    (root / "as_pngs" / "caption.txt").write_text("a red car")
    _write_video(root / "as_video.mp4", frames)
    (root / "as_video.txt").write_text("a red car\n")
    over = [k for k in keys(sources) if not k.startswith(("data.path=", "data.frames="))]
    over += [f"data.path={tmp_path / 'cache'}", f"data.frames={root}"]
    assert main(["data", "prepare", str(RECIPE), *over]) == 0
    capsys.readouterr()
    png, video = (load_file(tmp_path / "cache" / "clips" / f"{n}.safetensors") for n in ("as_pngs", "as_video"))
    assert video["x0"].shape == (CHANNELS, 2, 2, 4)
    for key in ("x0", "text"):
        torch.testing.assert_close(video[key], png[key], rtol=0, atol=0)

    bad = tmp_path / "bad"
    bad.mkdir()
    cases = [("random bytes", lambda p: p.write_bytes(bytes(range(256)) * 64), "not a readable video"),
             ("truncated", lambda p: p.write_bytes((root / "as_video.mp4").read_bytes()[:300]),
              "not a readable video"),
             ("no caption", lambda p: _write_video(p, frames[:1]), "has no caption"),
             ("odd size", lambda p: _write_video(p, [f[:, :24] for f in frames[:1]]), "multiples of 16")]
    for what, make, fragment in cases:
        for old in bad.iterdir():
            old.unlink()
        make(bad / "clip.mp4")
        if what not in ("no caption",):
            (bad / "clip.txt").write_text("x")
        over = [k for k in keys(sources) if not k.startswith(("data.path=", "data.frames="))]
        over += [f"data.path={tmp_path / what.replace(' ', '_')}", f"data.frames={bad}"]
        assert main(["data", "prepare", str(RECIPE), *over]) == 2, what
        err = capsys.readouterr().err
        assert "'data.frames" in err and "clip.mp4" in err and fragment in err and err.count("\n") == 1, (what, err)


@pytest.mark.parametrize(("override", "key", "fragment"), [
    ("data.frames=null", "data.frames", "needs data.frames"),
    ("data.autoencoder={frames}", "data.autoencoder", "AutoencoderKLWan"),
    ("data.text_encoder={autoencoder}", "data.text_encoder", "UMT5"),
    ("model.preset=wan-tiny", "data.frames", None),
    ("data.image_encoder={text_encoder}", "data.image_encoder", "no image-encoder tokens"),
])
def test_bad_prepare_settings_are_one_line(tmp_path, sources, capsys, override, key, fragment):
    over = [k for k in keys(sources) if not k.startswith(override.split("=")[0] + "=")]
    over = [*over, override.format(**sources)] if fragment else over
    over = [o.replace(str(sources["cache"]), str(tmp_path / "cache")) for o in over]
    if fragment is None:  # a clip the autoencoder cannot take: 3 frames
        bad = tmp_path / "frames" / "clip"
        bad.mkdir(parents=True)
        for i in range(3):
            (bad / f"{i:03d}.png").write_bytes((sources["frames"] / "a_walk" / f"{i:03d}.png").read_bytes())
        (bad / "caption.txt").write_text("x")
        over = [o for o in over if not o.startswith("data.frames=")] + [f"data.frames={tmp_path / 'frames'}"]
        fragment = "1 + 4 k frames"
    assert main(["data", "prepare", str(RECIPE), *over]) == 2
    err = capsys.readouterr().err
    assert f"'{key}" in err and fragment in err and err.count("\n") == 1, err

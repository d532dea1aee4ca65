"""Qwen-Image's latent cache: ``loongforge data prepare`` on generated images with captions through a tiny
diffusers-saved ``AutoencoderKLQwenImage`` and a tiny transformers-saved Qwen2.5-VL text encoder; the cached latents
decode to what the autoencoder's own encode -> decode of the image gives, the cached text is what
``QwenImagePipeline.encode_prompt`` gives for the caption, and the tiny recipe trains on the cache (images of two
sizes, packed). Bad images and captions are one line naming the file.

NOTE: the megatron job runs in a rank (``ranks``), never in pytest's own process."""

from __future__ import annotations

from pathlib import Path

import loongforge
import pytest
import torch
from loongforge.cli import main

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "diffusion" / "qwen_image_tiny.yaml"
CHANNELS, TEXT_DIM, TEXT_LENGTH = 4, 32, 48  # the qwen-image-tiny preset's latent channels and text width
IMAGES = {"a_cat": ((32, 48), "a cat sits on a red mat", ".png"), "b_sky": ((16, 32), "blue sky", ".jpg")}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Images with captions, a tiny AutoencoderKLQwenImage and a tiny Qwen2.5-VL with a tokenizer."""
    import transformers as tf
    from diffusers import AutoencoderKLQwenImage
    from loongforge_megatron.data.tokenizer import train_bpe
    from PIL import Image

    root = tmp_path_factory.mktemp("qwen_image_cache")
    g = torch.Generator().manual_seed(0)
    (root / "images").mkdir()
    for name, ((h, w), caption, suffix) in IMAGES.items():
        pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(root / "images" / f"{name}{suffix}", quality=95)
        (root / "images" / f"{name}.txt").write_text(caption + "\n")
    torch.manual_seed(0)
    AutoencoderKLQwenImage(base_dim=8, z_dim=CHANNELS, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
                           latents_mean=[0.1 * i for i in range(CHANNELS)],
                           latents_std=[1.0 + 0.1 * i for i in range(CHANNELS)]).save_pretrained(root / "vae")
    text = root / "text_encoder"
    corpus = ["<|im_start|>system describe the image <|im_end|> user assistant", *(c for _, c, _ in IMAGES.values())]
    tok = train_bpe(corpus * 4, vocab_size=300, out_dir=text)
    cfg = tf.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT_DIM,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0]))
    tf.Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(text)
    return {"images": root / "images", "autoencoder": root / "vae", "text_encoder": text, "cache": root / "cache"}


def keys(sources: dict[str, Path], cache: Path | None = None) -> list[str]:
    return ["data.format=latent_cache", f"data.path={cache or sources['cache']}", f"data.images={sources['images']}",
            f"data.autoencoder={sources['autoencoder']}", f"data.text_encoder={sources['text_encoder']}",
            f"data.text_length={TEXT_LENGTH}"]


def _train_on_cache(*, rank, world, tmp_path, overrides):
    recipe = loongforge.load_recipe(RECIPE, ["accelerator=cpu", "logging.console=false", "train.steps=2",
                                             "train.warmup_steps=0", "train.global_batch_size=2",
                                             "train.micro_batch_size=2", *overrides])
    job, runtime = loongforge.build_job(recipe, output_dir=tmp_path / "run")
    try:
        batch = job.schedule.microbatches(0, device=torch.device("cpu"))[0]
        return [job.step()["loss"] for _ in range(2)], batch["grid"].tolist(), batch["text_mask"].sum(-1).tolist()
    finally:
        job.close()
        runtime.logger.close()


def test_prepared_cache_holds_the_pipelines_latents_and_prompt_embeddings_and_trains(tmp_path, ranks, sources,
                                                                                   capsys):
    import transformers as tf
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from loongforge_megatron.models.qwen_image.cache import read_image
    from safetensors.torch import load_file

    assert main(["data", "prepare", str(RECIPE), *keys(sources)]) == 0
    assert f"prepared: {sources['cache']}" in capsys.readouterr().out
    vae = AutoencoderKLQwenImage.from_pretrained(sources["autoencoder"]).eval()
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, transformer=None,
                             text_encoder=tf.Qwen2_5_VLForConditionalGeneration.from_pretrained(sources["text_encoder"]),
                             tokenizer=tf.AutoTokenizer.from_pretrained(sources["text_encoder"]))
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    lengths = {}
    for name, ((h, w), caption, suffix) in IMAGES.items():
        stored = load_file(sources["cache"] / "records" / f"{name}.safetensors")
        image, read_caption = read_image(sources["images"] / f"{name}{suffix}", multiple=16)
        assert read_caption == caption
        with torch.no_grad():
            latent = vae.encode(image[None, :, None]).latent_dist.mode()
            embeds, mask = pipe.encode_prompt(caption, device=torch.device("cpu"))
        torch.testing.assert_close(stored["x0"], ((latent - mean) / std)[0, :, 0], rtol=1e-5, atol=1e-5)
        assert stored["x0"].shape == (CHANNELS, h // 8, w // 8) and mask is None
        torch.testing.assert_close(stored["text"], embeds[0], rtol=1e-5, atol=1e-5)
        lengths[(h // 16) * (w // 16)] = min(embeds.shape[1], TEXT_LENGTH)
    # a second prepare finds the cache complete
    assert main(["data", "prepare", str(RECIPE), *keys(sources)]) == 0
    losses, grids, masked = ranks(_train_on_cache, world=1, out=tmp_path / "one", tmp_path=tmp_path,
                                  overrides=keys(sources))[0]
    assert sorted(map(tuple, grids)) == [(1, 1, 2), (1, 2, 3)]  # both images, packed in one micro-batch
    assert {g[1] * g[2]: m for g, m in zip(grids, masked, strict=True)} == lengths  # each caption's own tokens
    assert all(torch.isfinite(torch.tensor(losses))) and losses[0] != losses[1]


@pytest.mark.parametrize(("case", "fragment"), [
    ("no caption", "has no caption"), ("empty caption", "is empty"), ("truncated image", "not a readable image"),
    ("odd size", "multiples of 16"), ("text as image", "not a readable image"),
])
def test_bad_images_are_one_line(tmp_path, sources, capsys, case, fragment):
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    good = sources["images"] / "a_cat.png"
    target = folder / "x.png"
    if case == "truncated image":
        target.write_bytes(good.read_bytes()[:200])
    elif case == "odd size":
        Image.new("RGB", (24, 16)).save(target)
    elif case == "text as image":
        target.write_text("not an image")
    else:
        target.write_bytes(good.read_bytes())
    if case != "no caption":
        (folder / "x.txt").write_text("" if case == "empty caption" else "a cat")
    over = [o for o in keys(sources, tmp_path / "cache") if not o.startswith("data.images=")]
    assert main(["data", "prepare", str(RECIPE), *over, f"data.images={folder}"]) == 2
    err = capsys.readouterr().err
    assert "'data.images" in err and "x." in err and fragment in err and err.count("\n") == 1, err


@pytest.mark.parametrize(("override", "key", "fragment"), [
    ("data.images=null", "data.images", "needs data.images"),
    ("data.autoencoder={images}", "data.autoencoder", "AutoencoderKLQwenImage"),
    ("data.text_encoder={autoencoder}", "data.text_encoder", "Qwen2.5-VL"),
])
def test_bad_prepare_settings_are_one_line(tmp_path, sources, capsys, override, key, fragment):
    name = override.split("=")[0]
    over = [o for o in keys(sources, tmp_path / "cache") if not o.startswith(name + "=")]
    assert main(["data", "prepare", str(RECIPE), *over, override.format(**sources)]) == 2
    err = capsys.readouterr().err
    assert f"'{key}" in err and fragment in err and err.count("\n") == 1, err


def test_cache_settings_are_checked_at_validate(capsys):
    for override, key in (("data.packed_sizes=[[8,8]]", "data.packed_sizes"),
                          ("data.reference_images=1", "data.reference_images")):
        assert main(["validate", str(RECIPE), "data.format=latent_cache", "data.path=/tmp/x", override]) == 2
        err = capsys.readouterr().err
        assert f"'{key}" in err and err.count("\n") == 1, err


def test_a_cache_of_another_text_width_is_refused_and_old_indexes_read(tmp_path, sources):
    """A cache whose prepared.json records another text width is one line naming data.path and the command that
    rebuilds it; an index in the first caches' layout ("clips") still reads."""
    import json
    import shutil

    from loongforge.errors import RecipeError
    from loongforge_megatron.models import latent_cache as lc
    from loongforge_megatron.models.flow_matching import FlowMatching
    from loongforge_megatron.models.qwen_image.cache import LatentImages

    assert main(["data", "prepare", str(RECIPE), *keys(sources, tmp_path / "cache")]) == 0
    recipe = loongforge.load_recipe(RECIPE, keys(sources, tmp_path / "cache"))
    arch = recipe.model.arch()

    def open_cache():
        return LatentImages(path=str(tmp_path / "cache"), arch=arch, data=recipe.data, objective=FlowMatching(),
                            seed=1, parts=1, rope_positions=4096)

    assert len(open_cache()) == len(IMAGES)
    done = json.loads((tmp_path / "cache" / lc.DONE).read_text())
    (tmp_path / "cache" / lc.DONE).write_text(json.dumps({**done, "text_dim": TEXT_DIM + 1}))
    with pytest.raises(RecipeError) as err:
        open_cache()
    assert err.value.key == "data.path" and "prepare --force" in str(err.value) and "\n" not in str(err.value)
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "cache", old)
    index = json.loads((old / lc.INDEX).read_text())
    (old / lc.INDEX).write_text(json.dumps({"clips": index["records"]}))
    assert lc.read_index(old)[1] == index["records"]

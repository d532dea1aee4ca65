"""Wan (video diffusion transformer) on megatron-core against diffusers' WanTransformer3DModel (fp32, CPU), for a
T2V, an I2V (image-encoder branch) and a TI2V-shaped (per-token timesteps, no cross-attention norm) config: the
same forward from the same weights at TP 2, the first flow-matching loss equal to a plain-torch reference calling
diffusers' model, diffusers -> ours (tp 2) -> diffusers bitwise online and offline, the tiny recipe at TP 2 equal
to one process with a falling loss, and one-line errors.

NOTE: every megatron job here runs in a rank (``ranks``), never in pytest's own process."""

from __future__ import annotations

import math
from pathlib import Path

import loongforge
import pytest
import torch
from loongforge.cli import main

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "diffusion" / "wan_tiny.yaml"
RTOL = 1e-5
GRID = (3, 4, 4)  # latent frames, height, width of the probes and batches
IMAGE_TOKENS = 5
CONFIGS = {
    "t2v": dict(num_attention_heads=4, attention_head_dim=12, in_channels=4, out_channels=4, ffn_dim=64),
    # Wan2.1 I2V: condition channels and an image-encoder branch; diffusers splits the image tokens off a 512-token
    # text, so its text is 512 tokens long
    "i2v": dict(num_attention_heads=4, attention_head_dim=12, in_channels=12, out_channels=4, ffn_dim=64,
                image_dim=8, added_kv_proj_dim=48),
    # Wan2.2 TI2V-shaped: one timestep per token, no cross-attention norm, wider heads
    "ti2v": dict(num_attention_heads=2, attention_head_dim=24, in_channels=6, out_channels=6, ffn_dim=96,
                 cross_attn_norm=False),
}
TEXT_LENGTH = {"t2v": 7, "i2v": 512, "ti2v": 7}


def save_wan(out: Path, name: str, *, seed: int = 0) -> Path:
    """A tiny random-init WanTransformer3DModel of config ``name``, every weight perturbed (none left at 0 or 1)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), text_dim=16, freq_dim=16, num_layers=2, rope_max_seq_len=32,
                                  **CONFIGS[name])
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g) + (1.0 if "norm" in n and n.endswith("weight") else 0.0))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wan")
    return {name: save_wan(root / name, name) for name in CONFIGS}


def probe(name: str) -> dict[str, torch.Tensor | None]:
    """Inputs of one forward: noisy input, timesteps (per token for ti2v), text, image tokens."""
    cfg, g = CONFIGS[name], torch.Generator().manual_seed(7)
    x = torch.randn(2, cfg["in_channels"], *GRID, generator=g)
    tokens = GRID[0] * (GRID[1] // 2) * (GRID[2] // 2)
    t = torch.tensor([0.0, 731.5])
    if name == "ti2v":
        t = t[:, None].expand(2, tokens).clone()
        t[:, : tokens // GRID[0]] = 0.0  # NOTE: TI2V's first (condition) frame is clean
    image = torch.randn(2, IMAGE_TOKENS, cfg["image_dim"], generator=g) if "image_dim" in cfg else None
    return {"x": x, "t": t, "text": torch.randn(2, TEXT_LENGTH[name], 16, generator=g), "image": image}


def diffusers_forward(model, p: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(p["x"], p["t"], p["text"], encoder_hidden_states_image=p["image"]).sample


def reference_loss(model, batches: list[dict]) -> float:
    """The flow-matching loss written out in plain torch around diffusers' model: x_t = (1 - s) x0 + s noise
    (condition channels appended), timestep 1000 s, MSE against the velocity noise - x0 over the global batch."""
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            s = b["sigmas"].view(-1, 1, 1, 1, 1)
            xt = (1 - s) * b["x0"] + s * b["noise"]
            if "condition" in b:
                xt = torch.cat([xt, b["condition"]], dim=1)
            pred = model(xt, b["sigmas"] * 1000, b["text"], encoder_hidden_states_image=b.get("image")).sample
            err = (pred - (b["noise"] - b["x0"])).pow(2)
            total, count = total + float(err.sum()), count + err.numel()
    return total / count


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def cpt(hf_dir: Path, name: str) -> list[str]:
    f, h, w = GRID
    return [f"model={{hf: {hf_dir}}}", f"checkpoint.load={hf_dir}", "train.stage=cpt", "train.steps=1",
            "train.warmup_steps=0", "accelerator=cpu", "logging.console=false", "parallel.tp=2",
            "train.global_batch_size=4", "train.micro_batch_size=2", f"data.latent_frames={f}",
            f"data.latent_height={h}", f"data.latent_width={w}", f"data.text_length={TEXT_LENGTH[name]}",
            f"data.image_tokens={IMAGE_TOKENS}", "data.text_dropout=0.5", "data.timestep_sampling=logit_normal",
            "data.timestep_shift=3.0"]


def _tp2_jobs(*, rank, world, tmp_path, hf_dirs, probes, steps, ports):
    """Each config at TP 2: forward on the probe, an export before training, the first step's batches and loss;
    a LoRA run's exports; TI2V at CP 2 (forward, first loss); the tiny recipe's first ``steps`` losses at TP 2, at
    CP 2 and at TP 2 + sequence parallelism.

    NOTE: each job starts its own process group, on a port of its own (a torn-down store's port refuses the next)."""
    import os

    out = {}
    for (name, hf_dir), port in zip(hf_dirs.items(), ports, strict=False):
        os.environ["MASTER_PORT"] = str(port)
        job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, cpt(hf_dir, name)),
                                            output_dir=tmp_path / f"run_{name}")
        try:
            p = probes[name]
            with torch.no_grad():
                ours = job.chunks[0](p["x"], p["t"], p["text"], p["image"])
            job.export("hf", tmp_path / f"back_{name}")
            batches = job.schedule.microbatches(0, device=torch.device("cpu"))
            loss = job.step()["loss"]
        finally:
            job.close()
            runtime.logger.close()
        out[name] = (ours, batches, loss)
    os.environ["MASTER_PORT"] = str(ports[-4])
    lora = [*cpt(hf_dirs["i2v"], "i2v"), "train.stage=lora", "train.steps=2", "train.lr=0.05", "train.lora.rank=4",
            "train.lora.alpha=8"]
    job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, lora), output_dir=tmp_path / "lora")
    try:
        [job.step() for _ in range(2)]
        job.export("peft", tmp_path / "lora_peft")
        job.export("hf", tmp_path / "lora_merged")
    finally:
        job.close()
        runtime.logger.close()
    os.environ["MASTER_PORT"] = str(ports[-3])
    over = [*cpt(hf_dirs["ti2v"], "ti2v"), "parallel.tp=1", "parallel.cp=2"]
    job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, over), output_dir=tmp_path / "cp2")
    try:
        p = probes["ti2v"]
        with torch.no_grad():
            ours = job.chunks[0](p["x"], p["t"], p["text"], p["image"])
        batches = job.schedule.microbatches(0, device=torch.device("cpu"))
        out["cp2"] = (ours, batches, job.step()["loss"])
    finally:
        job.close()
        runtime.logger.close()
    for layout, port, parallel in (("tp", ports[-2], ["parallel.tp=2"]), ("cp", ports[-1], ["parallel.cp=2"]),
                                   ("sp", ports[len(hf_dirs)], ["parallel.tp=2", "parallel.sp=true"])):
        os.environ["MASTER_PORT"] = str(port)
        over = ["accelerator=cpu", "logging.console=false", *parallel, f"train.steps={steps}"]
        job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, over), output_dir=tmp_path / f"{layout}2")
        try:
            out[f"tiny_{layout}2"] = [job.step()["loss"] for _ in range(steps)]
        finally:
            job.close()
            runtime.logger.close()
    return out


def _tiny_one_process(*, rank, world, tmp_path, steps):
    """The tiny recipe's losses in one process, and its first ``steps`` with whole blocks recomputed."""
    out = {}
    for name, over in (("eager", []), ("recompute", ["parallel.recompute=full", f"train.steps={steps}"])):
        recipe = loongforge.load_recipe(RECIPE, ["accelerator=cpu", "logging.console=false", *over])
        job, runtime = loongforge.build_job(recipe, output_dir=tmp_path / f"tiny_{name}")
        try:
            out[name] = [job.step()["loss"] for _ in range(job.recipe.train.steps)]
        finally:
            job.close()
            runtime.logger.close()
    return out


def test_tp2_and_cp2_equal_diffusers_and_one_process(tmp_path, ranks, hf_dirs, free_port):
    """T2V / I2V / TI2V loaded at TP 2 (one gloo launch): our forward = diffusers' (<= 1e-5 relative), the first
    flow-matching loss = the plain-torch reference around diffusers' model, the export before training = the source
    files bitwise and loads in diffusers cleanly; a LoRA run's export loads in a WanPipeline and computes the merged
    weights' function; TI2V at CP 2 (Ulysses) = diffusers; the tiny recipe at TP 2, at CP 2, at TP 2 + sequence
    parallelism and with full recompute gives the one-process losses, which fall."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    refs = {name: WanTransformer3DModel.from_pretrained(d).eval() for name, d in hf_dirs.items()}
    probes = {name: probe(name) for name in hf_dirs}
    steps = 4
    got = ranks(_tp2_jobs, world=2, out=tmp_path / "tp2", tmp_path=tmp_path, hf_dirs=hf_dirs, probes=probes,
                steps=steps, ports=[free_port() for _ in range(len(hf_dirs) + 5)])
    single = ranks(_tiny_one_process, world=1, out=tmp_path / "one", tmp_path=tmp_path, steps=steps)[0]
    one = single["eager"]
    assert single["recompute"] == pytest.approx(one[:steps], rel=RTOL)
    for name, hf_dir in hf_dirs.items():
        ours, batches, loss = got[0][name]
        assert got[1][name][2] == loss
        want = diffusers_forward(refs[name], probes[name])
        assert rel_err(ours, want) <= RTOL, (name, rel_err(ours, want))
        assert loss == pytest.approx(reference_loss(refs[name], batches), rel=RTOL), name
        texts = torch.cat([b["text"] for b in batches])
        assert bool((texts.flatten(1).abs().sum(1) == 0).any()), name  # classifier-free-guidance text dropout
        src = load_file(hf_dir / "diffusion_pytorch_model.safetensors")
        back = load_file(tmp_path / f"back_{name}" / "diffusion_pytorch_model.safetensors")
        assert sorted(src) == sorted(back) and all(torch.equal(src[k], back[k]) for k in src), name
        model, info = WanTransformer3DModel.from_pretrained(tmp_path / f"back_{name}", output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        assert sum(p.numel() for p in model.parameters()) == _arch(hf_dir).num_params(), name
    _lora_export_loads_in_a_pipeline(tmp_path, hf_dirs["i2v"], probes["i2v"])
    ours, batches, loss = got[0]["cp2"]  # Ulysses context parallelism over the video tokens
    assert rel_err(ours, diffusers_forward(refs["ti2v"], probes["ti2v"])) <= RTOL
    assert loss == pytest.approx(reference_loss(refs["ti2v"], batches), rel=RTOL)
    assert got[0]["tiny_tp2"] == pytest.approx(one[:steps], rel=RTOL)
    assert got[0]["tiny_cp2"] == pytest.approx(one[:steps], rel=RTOL)
    assert got[0]["tiny_sp2"] == pytest.approx(one[:steps], rel=RTOL)  # TP 2 + sequence parallelism
    first, last = sum(one[:5]) / 5, sum(one[-5:]) / 5
    assert last < 0.8 * first, (first, last)


PACKED_FRAMES = (2, 3, 1)  # a probe's videos: 8 + 12 + 4 tokens, so cp 2 cuts the second one
PACKED_STEPS = 5


def packed_probe(name: str) -> dict:
    """Three videos of different lengths (the probe's height and width) with their own timesteps / texts / image
    tokens: each alone (diffusers' input) and packed (ours: patch tokens joined, one grid row per video)."""
    from loongforge_megatron.models.wan.model import patchify

    cfg, g = CONFIGS[name], torch.Generator().manual_seed(11)
    videos = [torch.randn(1, cfg["in_channels"], f, *GRID[1:], generator=g) for f in PACKED_FRAMES]
    t = torch.tensor([0.0, 731.5, 250.0])
    text = torch.randn(len(videos), TEXT_LENGTH[name], 16, generator=g)
    image = torch.randn(len(videos), IMAGE_TOKENS, cfg["image_dim"], generator=g) if "image_dim" in cfg else None
    return {"videos": videos, "t": t, "text": text, "image": image,
            "patches": torch.cat([patchify(v, (1, 2, 2))[0] for v in videos]),
            "grids": [(f, GRID[1] // 2, GRID[2] // 2) for f in PACKED_FRAMES]}


#: the packed layouts of one launch: (name, the probe's config, parallel overrides)
PACKED_LAYOUTS = (("p2p", "i2v", ["parallel.tp=1", "parallel.cp=2", "model.cp_comm_type=p2p"]),
                  ("a2a", "t2v", ["parallel.tp=1", "parallel.cp=2", "model.cp_comm_type=a2a"]),
                  ("sp", "i2v", ["parallel.tp=2", "parallel.sp=true"]))


def _packed_jobs(*, rank, world, tmp_path, hf_dirs, probes, ports):
    """Packed videos at CP 2 (I2V with the ring, T2V with Ulysses) and at TP 2 + sequence parallelism (I2V): this
    rank's share of the packed forward; the tiny recipe with packed variable-length samples: its first steps'
    losses in each layout."""
    import os

    out = {}
    for (layout, name, parallel), port in zip(PACKED_LAYOUTS, ports, strict=False):
        os.environ["MASTER_PORT"] = str(port)
        over = [*cpt(hf_dirs[name], name), *parallel, "data.packed_frames=[1,2,3]"]
        job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, over), output_dir=tmp_path / layout)
        try:
            p = probes[name]
            with torch.no_grad():
                out[layout] = job.chunks[0](p["patches"], p["t"], p["text"], p["image"], grids=p["grids"])[0]
        finally:
            job.close()
            runtime.logger.close()
    for (layout, _, parallel), port in zip(PACKED_LAYOUTS, ports[len(PACKED_LAYOUTS):], strict=True):
        os.environ["MASTER_PORT"] = str(port)
        recipe = loongforge.load_recipe(RECIPE, [*TINY_PACKED, *parallel])
        job, runtime = loongforge.build_job(recipe, output_dir=tmp_path / f"tiny_{layout}")
        try:
            out[f"tiny_{layout}"] = [job.step()["loss"] for _ in range(PACKED_STEPS)]
        finally:
            job.close()
            runtime.logger.close()
    return out


TINY_PACKED = ["accelerator=cpu", "logging.console=false", f"train.steps={PACKED_STEPS}", "data.packed_frames=[1,2,3]"]


def _tiny_packed_one_process(*, rank, world, tmp_path):
    recipe = loongforge.load_recipe(RECIPE, TINY_PACKED)
    job, runtime = loongforge.build_job(recipe, output_dir=tmp_path / "tiny_packed_one")
    try:
        return [job.step()["loss"] for _ in range(PACKED_STEPS)]
    finally:
        job.close()
        runtime.logger.close()


def test_packed_videos_at_cp2_and_tp2_sp_equal_diffusers_and_one_process(tmp_path, ranks, hf_dirs, free_port):
    """Videos of different lengths packed into one sequence, split over 2 ranks (the cut falls inside a video):
    at CP 2 with the ring (I2V) and Ulysses (T2V) and at TP 2 + sequence parallelism (I2V) the forward equals
    diffusers' on each video alone (<= 1e-5 relative); the tiny recipe on packed variable-length samples gives the
    one-process losses over 5 steps in each layout."""
    from diffusers import WanTransformer3DModel
    from loongforge_megatron.models.wan.model import patchify

    probes = {name: packed_probe(name) for name in ("i2v", "t2v")}
    got = ranks(_packed_jobs, world=2, out=tmp_path / "two", tmp_path=tmp_path, hf_dirs=hf_dirs, probes=probes,
                ports=[free_port() for _ in range(2 * len(PACKED_LAYOUTS))])
    one = ranks(_tiny_packed_one_process, world=1, out=tmp_path / "one", tmp_path=tmp_path)[0]
    want = {}
    for name, p in probes.items():
        ref = WanTransformer3DModel.from_pretrained(hf_dirs[name]).eval()
        parts = []
        for i, video in enumerate(p["videos"]):
            image = None if p["image"] is None else p["image"][i: i + 1]
            single = {"x": video, "t": p["t"][i: i + 1], "text": p["text"][i: i + 1], "image": image}
            parts.append(patchify(diffusers_forward(ref, single), (1, 2, 2))[0])
        want[name] = torch.cat(parts)
    for layout, name, _ in PACKED_LAYOUTS:
        # NOTE: a CP rank returns its tokens; sequence parallelism gathers the TP ranks' for the loss
        ours = got[0][layout] if layout == "sp" else torch.cat([got[0][layout], got[1][layout]])
        assert rel_err(ours, want[name]) <= RTOL, (layout, rel_err(ours, want[name]))
        assert got[0][f"tiny_{layout}"] == pytest.approx(one, rel=RTOL), layout
        assert got[1][f"tiny_{layout}"] == got[0][f"tiny_{layout}"]
    assert one[-1] != one[0]


def _unpatchify(tokens: torch.Tensor, grid: tuple[int, int, int], channels: int) -> torch.Tensor:
    """The inverse of ``patchify`` for one video of patch ``grid`` with (1, 2, 2) patches: ``[1, c, F, H, W]``."""
    f, h, w = grid
    x = tokens.reshape(1, f, h, w, 1, 2, 2, channels).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.reshape(1, channels, f, h * 2, w * 2)


def clean_first_reference(model, batches: list[dict], channels: int) -> tuple[float, int]:
    """TI2V image-to-video training written out around diffusers' model, one video at a time: a sample with
    ``first_clean`` keeps its first latent frame clean with timestep 0 on its tokens (the pipeline's
    expand_timesteps) and leaves those tokens out of the MSE; returns the loss and the clean samples counted."""
    total, count, cleans = 0.0, 0, 0
    with torch.no_grad():
        for b in batches:
            if "grid" in b:
                grids = [tuple(int(v) for v in g) for g in b["grid"].tolist()]
                sizes = [math.prod(g) for g in grids]
                videos = [(_unpatchify(x, g, channels), _unpatchify(n, g, channels), g)
                          for x, n, g in zip(b["x0"].split(sizes), b["noise"].split(sizes), grids, strict=True)]
            else:
                grids = [(b["x0"].shape[2], b["x0"].shape[3] // 2, b["x0"].shape[4] // 2)] * len(b["x0"])
                videos = [(b["x0"][i: i + 1], b["noise"][i: i + 1], grids[i]) for i in range(len(b["x0"]))]
            for i, (x0, noise, (f, h, w)) in enumerate(videos):
                s, clean = float(b["sigmas"][i]), bool(b["first_clean"][i])
                xt = (1 - s) * x0 + s * noise
                t = torch.full((1, f * h * w), s * 1000)
                if clean:
                    xt[:, :, 0], t[:, : h * w] = x0[:, :, 0], 0.0
                    cleans += 1
                pred = model(xt, t, b["text"][i: i + 1]).sample
                err = (pred - (noise - x0)).pow(2)
                if clean:
                    err = err[:, :, 1:]
                total, count = total + float(err.sum()), count + err.numel()
    return total / count, cleans


def _clean_first_jobs(*, rank, world, tmp_path, hf_dir, ports):
    """The TI2V config trained image-to-video (first frame clean for about half the samples), unpacked and packed:
    each one's first-step micro-batches and loss."""
    import os

    out = {}
    for (layout, extra), port in zip((("unpacked", []), ("packed", ["data.packed_frames=[1,2,3]"])), ports,
                                     strict=True):
        os.environ["MASTER_PORT"] = str(port)
        over = [*cpt(hf_dir, "ti2v"), "parallel.tp=1", "data.first_frame_clean=0.5", *extra]
        job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, over), output_dir=tmp_path / layout)
        try:
            batches = job.schedule.microbatches(0, device=torch.device("cpu"))
            out[layout] = (batches, job.step()["loss"])
        finally:
            job.close()
            runtime.logger.close()
    return out


def test_ti2v_clean_first_frame_equals_the_pipelines_per_token_timesteps(tmp_path, ranks, hf_dirs, free_port):
    """data.first_frame_clean (TI2V image-to-video): the first loss, unpacked and packed, equals a plain-torch
    reference that calls diffusers' model with the pipeline's per-token timesteps (0 on the clean first frame) and
    scores only the other frames."""
    from diffusers import WanTransformer3DModel

    got = ranks(_clean_first_jobs, world=1, out=tmp_path / "one", tmp_path=tmp_path, hf_dir=hf_dirs["ti2v"],
                ports=[free_port() for _ in range(2)])[0]
    ref = WanTransformer3DModel.from_pretrained(hf_dirs["ti2v"]).eval()
    for layout, (batches, loss) in got.items():
        want, cleans = clean_first_reference(ref, batches, CONFIGS["ti2v"]["out_channels"])
        assert 0 < cleans < 4, (layout, cleans)  # NOTE: clean and noised first frames in one batch
        assert loss == pytest.approx(want, rel=RTOL), layout


def _lora_export_loads_in_a_pipeline(tmp_path: Path, hf_dir: Path, p: dict) -> None:
    """The LoRA run's export (diffusers format) loads with ``WanPipeline.load_lora_weights`` into a pipeline built
    from the base checkpoint, and its transformer then computes the merged export's function."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(),
                       transformer=WanTransformer3DModel.from_pretrained(hf_dir).eval())
    base = diffusers_forward(pipe.transformer, p)
    pipe.load_lora_weights(tmp_path / "lora_peft")
    merged = diffusers_forward(WanTransformer3DModel.from_pretrained(tmp_path / "lora_merged").eval(), p)
    adapted = diffusers_forward(pipe.transformer, p)
    assert rel_err(adapted, merged) <= RTOL, rel_err(adapted, merged)
    assert rel_err(base, merged) > 1e-3  # the adapters changed the model


def _arch(hf_dir: Path):
    from loongforge_megatron.models.hf_arch import arch_from_hf

    return arch_from_hf(hf_dir)


def test_offline_round_trip_through_tp2_is_bitwise(tmp_path, hf_dirs):
    """``loongforge convert`` diffusers -> megatron (tp 2) -> diffusers keeps every tensor bitwise."""
    from safetensors.torch import load_file

    for name, hf_dir in hf_dirs.items():
        assert main(["convert", str(hf_dir), str(tmp_path / f"mg_{name}"), "--to", "megatron", "--tp", "2"]) == 0
        assert main(["convert", str(tmp_path / f"mg_{name}"), str(tmp_path / f"back_{name}"), "--to", "hf"]) == 0
        src = load_file(hf_dir / "diffusion_pytorch_model.safetensors")
        back = load_file(tmp_path / f"back_{name}" / "diffusion_pytorch_model.safetensors")
        assert sorted(src) == sorted(back) and all(torch.equal(src[k], back[k]) for k in src), name
    # an I2V checkpoint with the query norm of the image tokens that no Wan computes with (diffusers skips it too)
    import shutil

    from safetensors.torch import save_file

    extra = tmp_path / "extra"
    shutil.copytree(hf_dirs["i2v"], extra)
    tensors = load_file(extra / "diffusion_pytorch_model.safetensors")
    save_file({**tensors, "blocks.0.attn2.norm_added_q.weight": torch.ones(48)},
              extra / "diffusion_pytorch_model.safetensors")
    assert main(["convert", str(extra), str(tmp_path / "mg_extra"), "--to", "megatron", "--tp", "2"]) == 0


def test_presets_are_the_published_sizes():
    """Parameter counts of the presets against the published model sizes, and the config round trip."""
    from diffusers import WanTransformer3DModel
    from loongforge_megatron.models.wan.arch import PRESETS, WanArch, arch_from_diffusers, diffusers_config

    billions = {"wan2.1-t2v-1.3b": 1.3, "wan2.1-t2v-14b": 14, "wan2.1-i2v-14b": 14, "wan2.2-ti2v-5b": 5,
                "wan2.2-t2v-a14b": 14, "wan2.2-i2v-a14b": 14}
    for name, size in billions.items():
        arch = WanArch(**PRESETS[name])
        cfg = {k: v for k, v in diffusers_config(arch).items() if not k.startswith("_")}
        with torch.device("meta"):
            ref = WanTransformer3DModel(**cfg)
        assert arch.num_params() == sum(p.numel() for p in ref.parameters()), name
        assert math.isclose(arch.num_params() / 1e9, size, rel_tol=0.25), (name, arch.num_params())
        assert arch_from_diffusers(diffusers_config(arch)) == arch


@pytest.mark.parametrize(("overrides", "key", "fragment"), [
    (["parallel.tp=4", "model.ffn_hidden_size=130"], "parallel.tp", "do not split"),
    (["data.latent_height=7"], "data.latent_height", "patches of 2"),
    (["data.expert=high_noise"], "data", "boundary_ratio"),
    (["data.timestep_sampling=uniform", "data.logit_std=2.0"], "data", "logit_normal"),
    (["data.seq_length=64"], "data.seq_length", "not used by Wan"),
    (["parallel.recompute=selective"], "parallel.recompute", "full"),
    (["parallel.cp=8"], "parallel.cp", "tp x cp"),
    (["parallel.cp=2", "data.packed_frames=[1,2]", "data.latent_height=6", "data.latent_width=6"], "parallel.cp",
     "per latent frame"),
    (["data.packed_frames=[1,0]"], "data.packed_frames", "greater than 0"),
    (["model.cp_comm_type=ring"], "model.cp_comm_type", "p2p"),
    (["model.in_channels=36", "data.first_frame_clean=0.5"], "data.first_frame_clean", "condition channels"),
    (["parallel.cp=2", "data.latent_frames=3", "data.latent_height=6", "data.latent_width=6"], "parallel.cp", "do not split over cp"),
])
def test_unsupported_settings_are_refused(overrides, key, fragment, capsys):
    assert main(["validate", str(RECIPE), *overrides]) == 2
    err = capsys.readouterr().err
    assert f"'{key}" in err and fragment in err and err.count("\n") == 1, err


def test_noise_levels_follow_the_scheduler_and_the_expert():
    """The timestep shift is diffusers' FlowMatchEulerDiscreteScheduler's; one expert of a two-expert model draws
    only its side of boundary_ratio; flow matching's target is the velocity noise - x0."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from loongforge_megatron.models import flow_matching as fm

    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    plain = torch.linspace(1.0, 1 / 1000, 1000, dtype=torch.float64)
    shifted = fm.FlowMatching(shift=3.0).shifted(plain).float()
    torch.testing.assert_close(shifted, sched.sigmas.float(), rtol=1e-6, atol=1e-6)
    g = torch.Generator().manual_seed(0)
    for sampling in ("uniform", "logit_normal"):
        high = fm.FlowMatching(sampling=sampling, shift=5.0, sigma_range=(0.875, 1.0))
        low = fm.FlowMatching(sampling=sampling, shift=5.0, sigma_range=(0.0, 0.875))
        hs = torch.stack([high.draw_sigma(g) for _ in range(200)])
        ls = torch.stack([low.draw_sigma(g) for _ in range(200)])
        assert bool((hs >= 0.875).all() and (hs <= 1).all() and (ls < 0.875).all() and (ls >= 0).all()), sampling
    x0, noise, s = torch.randn(2, 3), torch.randn(2, 3), torch.tensor([0.0, 1.0])
    torch.testing.assert_close(fm.add_noise(x0, noise, s), torch.stack([x0[0], noise[1]]))


def test_bf16_parameters_train_with_fp32_norms(tmp_path, hf_dirs):
    """bf16 parameters (what a GPU run holds): the fp32 LayerNorms with weights (cross-attention norm, image
    projector) take their fp32 input, and a step gives a finite loss (its own process: megatron's state)."""
    import json
    import subprocess
    import sys

    overrides = [f"model={{hf: {hf_dirs['i2v']}}}", f"checkpoint.load={hf_dirs['i2v']}", "train.stage=cpt",
                 "train.steps=1", "train.warmup_steps=0", "train.precision=bf16", "accelerator=cpu",
                 "train.global_batch_size=2", "train.micro_batch_size=2",
                 f"data.text_length={TEXT_LENGTH['i2v']}", f"data.image_tokens={IMAGE_TOKENS}",
                 "data.latent_frames=2", "data.latent_height=4", "data.latent_width=4"]
    proc = subprocess.run([sys.executable, "-m", "loongforge", "train", str(RECIPE), *overrides, "--output",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 1 and math.isfinite(losses[0])

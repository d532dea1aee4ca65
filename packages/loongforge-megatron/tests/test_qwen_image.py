"""Qwen-Image (MMDiT) on megatron-core against diffusers' QwenImageTransformer2DModel (fp32, CPU), for a
text-to-image config and an Edit config (a reference image after the noisy one, zero_cond_t): the same forward
from the same weights at TP 2, the first flow-matching loss equal to a plain-torch reference calling diffusers'
model, diffusers -> ours (tp 2) -> diffusers bitwise online and offline, and one-line errors.

NOTE: every megatron job here runs in a rank (``ranks``), never in pytest's own process."""

from __future__ import annotations

import math
from pathlib import Path

import loongforge
import pytest
import torch
from loongforge.cli import main

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "diffusion" / "qwen_image_tiny.yaml"
RTOL = 1e-5
SIZE = (6, 8)  # latent rows, columns of the probes and batches
TEXT = 5
TINY_STEPS = 4
CONFIGS = {
    "t2i": dict(zero_cond_t=False),
    "edit": dict(zero_cond_t=True),
}


def save_qwen_image(out: Path, name: str, *, seed: int = 0) -> Path:
    """A tiny random-init QwenImageTransformer2DModel, every weight perturbed (none left at 0 or 1)."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                        attention_head_dim=12, num_attention_heads=4, joint_attention_dim=16,
                                        axes_dims_rope=(2, 4, 6), **CONFIGS[name])
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g) + (1.0 if "norm" in n and n.endswith("weight") else 0.0))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen_image")
    return {name: save_qwen_image(root / name, name) for name in CONFIGS}


def _pack(x: torch.Tensor) -> torch.Tensor:
    """The pipeline's ``_pack_latents`` written out: [b, c, H, W] -> [b, H/2 W/2, c 2 2]."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def grids(name: str) -> list[tuple[int, int, int]]:
    g = (1, SIZE[0] // 2, SIZE[1] // 2)
    return [g, g] if name == "edit" else [g]


def probe(name: str) -> dict[str, torch.Tensor]:
    """Inputs of one forward: packed tokens (noisy, then the reference's for edit), noise levels, text, mask."""
    g = torch.Generator().manual_seed(7)
    tokens = math.prod(SIZE) // 4 * len(grids(name))
    mask = torch.ones(2, TEXT, dtype=torch.bool)
    mask[1, 3:] = False
    return {"x": torch.randn(2, tokens, 16, generator=g), "t": torch.tensor([0.0, 0.7315]),
            "text": torch.randn(2, TEXT, 16, generator=g), "mask": mask}


def diffusers_forward(model, p: dict, name: str) -> torch.Tensor:
    with torch.no_grad():
        return model(p["x"], p["text"], p["mask"], p["t"], img_shapes=[grids(name)] * p["x"].shape[0]).sample


def reference_loss(model, batches: list[dict]) -> float:
    """The flow-matching loss written out in plain torch around diffusers' model: x_t = (1 - s) x0 + s noise,
    packed as the pipeline packs (the reference image's tokens after), timestep s, MSE of the noisy image's tokens
    against the velocity noise - x0 over the global batch."""
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            s = b["sigmas"].view(-1, 1, 1, 1)
            xt = _pack((1 - s) * b["x0"] + s * b["noise"])
            shapes = [(1, b["x0"].shape[-2] // 2, b["x0"].shape[-1] // 2)]
            inp = xt
            if "reference" in b:
                inp = torch.cat([xt, _pack(b["reference"][:, 0])], dim=1)
                shapes = shapes * 2
            pred = model(inp, b["text"], b["text_mask"], b["sigmas"], img_shapes=[shapes] * len(xt)).sample
            err = (pred[:, : xt.shape[1]] - _pack(b["noise"] - b["x0"])).pow(2)
            total, count = total + float(err.sum()), count + err.numel()
    return total / count


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def cpt(hf_dir: Path, name: str) -> list[str]:
    return [f"model={{hf: {hf_dir}}}", f"checkpoint.load={hf_dir}", "train.stage=cpt", "train.steps=1",
            "train.warmup_steps=0", "accelerator=cpu", "logging.console=false", "parallel.tp=2",
            "train.global_batch_size=4", "train.micro_batch_size=2", f"data.height={SIZE[0]}",
            f"data.width={SIZE[1]}", f"data.text_length={TEXT}", "data.text_dropout=0.5",
            "data.timestep_sampling=logit_normal", "data.timestep_shift=3.0",
            f"data.reference_images={1 if name == 'edit' else 0}"]


def _tp2_jobs(*, rank, world, tmp_path, hf_dirs, probes, ports):
    """Each config at TP 2: forward on the probe, an export before training, the first step's batches and loss.

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
                ours = job.chunks[0](p["x"], p["t"], p["text"], p["mask"], grids=grids(name))
            job.export("hf", tmp_path / f"back_{name}")
            batches = job.schedule.microbatches(0, device=torch.device("cpu"))
            loss = job.step()["loss"]
        finally:
            job.close()
            runtime.logger.close()
        out[name] = (ours, batches, loss)
    os.environ["MASTER_PORT"] = str(ports[-1])
    lora = [*cpt(hf_dirs["t2i"], "t2i"), "train.stage=lora", "train.steps=2", "train.lr=0.05", "train.lora.rank=4",
            "train.lora.alpha=8"]
    job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, lora), output_dir=tmp_path / "lora")
    try:
        [job.step() for _ in range(2)]
        job.export("peft", tmp_path / "lora_peft")
        job.export("hf", tmp_path / "lora_merged")
    finally:
        job.close()
        runtime.logger.close()
    out["tiny_tp2"] = _tiny(tmp_path / "tiny_tp2", port=ports[-2], overrides=["parallel.tp=2"])
    # TP 2 + sequence parallelism: Edit's forward (the reference image's tokens on rank 1), the tiny recipe's steps
    os.environ["MASTER_PORT"] = str(ports[-3])
    over = [*cpt(hf_dirs["edit"], "edit"), "parallel.sp=true"]
    job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, over), output_dir=tmp_path / "sp_edit")
    try:
        p = probes["edit"]
        with torch.no_grad():
            out["sp_edit"] = job.chunks[0](p["x"], p["t"], p["text"], p["mask"], grids=grids("edit"))
    finally:
        job.close()
        runtime.logger.close()
    out["tiny_sp2"] = _tiny(tmp_path / "tiny_sp2", port=ports[-4], overrides=["parallel.tp=2", "parallel.sp=true"])
    return out


def _tiny(out: Path, *, port: int, overrides: list[str]) -> tuple[list[float], torch.Tensor]:
    """The tiny recipe's first ``TINY_STEPS`` losses and then the first block's per-head query norm weight (held
    whole on every TP rank)."""
    import os

    os.environ["MASTER_PORT"] = str(port)
    over = ["accelerator=cpu", "logging.console=false", f"train.steps={TINY_STEPS}", "train.warmup_steps=0",
            *overrides]
    job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, over), output_dir=out)
    try:
        losses = [job.step()["loss"] for _ in range(TINY_STEPS)]
        norm = next(p for n, p in job.chunks[0].named_parameters() if n.endswith("layers.0.attn.q_layernorm.weight"))
        return losses, norm.detach().clone()
    finally:
        job.close()
        runtime.logger.close()


def _tiny_one_process(*, rank, world, tmp_path, port):
    return _tiny(tmp_path / "tiny_one", port=port, overrides=[])


def test_tp2_equals_diffusers(tmp_path, ranks, hf_dirs, free_port):
    """Text-to-image and Edit loaded at TP 2 (one gloo launch): our forward = diffusers' (<= 1e-5 relative, text
    padding masked), the first flow-matching loss = the plain-torch reference around diffusers' model, the export
    before training = the source files bitwise and loads in diffusers cleanly; a LoRA run's export loads in a
    QwenImagePipeline and computes the merged weights' function; the tiny recipe's first steps at TP 2 and at TP 2
    + sequence parallelism equal one process's (Edit's forward with sequence parallelism = diffusers')."""
    from diffusers import QwenImageTransformer2DModel
    from safetensors.torch import load_file

    refs = {name: QwenImageTransformer2DModel.from_pretrained(d).eval() for name, d in hf_dirs.items()}
    probes = {name: probe(name) for name in hf_dirs}
    got = ranks(_tp2_jobs, world=2, out=tmp_path / "tp2", tmp_path=tmp_path, hf_dirs=hf_dirs, probes=probes,
                ports=[free_port() for _ in range(len(hf_dirs) + 4)])
    one = ranks(_tiny_one_process, world=1, out=tmp_path / "one", tmp_path=tmp_path, port=free_port())[0]
    # NOTE: training steps after the first at TP 2 equal one process's (the per-head norms' gradients summed)
    assert got[0]["tiny_tp2"][0] == pytest.approx(one[0], rel=RTOL)
    assert got[0]["tiny_sp2"][0] == pytest.approx(one[0], rel=RTOL)  # TP 2 + sequence parallelism
    assert got[1]["tiny_sp2"][0] == got[0]["tiny_sp2"][0]
    sp_want = diffusers_forward(refs["edit"], probes["edit"], "edit")
    assert rel_err(got[0]["sp_edit"], sp_want) <= RTOL, rel_err(got[0]["sp_edit"], sp_want)
    assert one[0][-1] < one[0][0], one[0]
    assert torch.equal(got[0]["tiny_tp2"][1], got[1]["tiny_tp2"][1])
    assert rel_err(got[0]["tiny_tp2"][1] - 1, one[1] - 1) <= 1e-4  # NOTE: Adam's updates of the weight (from 1)
    for name, hf_dir in hf_dirs.items():
        ours, batches, loss = got[0][name]
        assert got[1][name][2] == loss
        want = diffusers_forward(refs[name], probes[name], name)
        assert rel_err(ours, want) <= RTOL, (name, rel_err(ours, want))
        assert loss == pytest.approx(reference_loss(refs[name], batches), rel=RTOL), name
        masks = torch.cat([b["text_mask"] for b in batches])
        assert bool((masks.sum(1) == 1).any()), name  # classifier-free-guidance text dropout
        src = load_file(hf_dir / "diffusion_pytorch_model.safetensors")
        back = load_file(tmp_path / f"back_{name}" / "diffusion_pytorch_model.safetensors")
        assert sorted(src) == sorted(back) and all(torch.equal(src[k], back[k]) for k in src), name
        model, info = QwenImageTransformer2DModel.from_pretrained(tmp_path / f"back_{name}", output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        assert sum(p.numel() for p in model.parameters()) == _arch(hf_dir).num_params(), name
    _lora_export_loads_in_a_pipeline(tmp_path, hf_dirs["t2i"], probes["t2i"])


CP_STEPS = 5
PACKED_SIZES = [(6, 8), (4, 4), (2, 8)]  # latent sizes of the packed probe: 12 + 4 + 4 tokens, cut by cp 2 in the first
TINY_PACKED = ["data.packed_sizes=[[8,8],[4,8],[4,4]]"]


def packed_probe() -> dict:
    """Three images of different sizes with their own noise levels and texts (one padded): each alone (diffusers'
    input) and packed (ours: patches joined, one grid row per image)."""
    g = torch.Generator().manual_seed(5)
    images = [torch.randn(1, (h // 2) * (w // 2), 16, generator=g) for h, w in PACKED_SIZES]
    mask = torch.ones(len(images), TEXT, dtype=torch.bool)
    mask[1, 2:] = False
    return {"images": images, "t": torch.tensor([0.1, 0.7315, 0.5]), "mask": mask,
            "text": torch.randn(len(images), TEXT, 16, generator=g), "patches": torch.cat([i[0] for i in images]),
            "grids": [(1, h // 2, w // 2) for h, w in PACKED_SIZES]}


def _cp2_jobs(*, rank, world, tmp_path, hf_dirs, probes, ports):
    """Each config at CP 2 (ring attention over the image tokens; Edit: rank 1 holds only the reference image, so
    it scores no tokens): this rank's share of the forward on the probe, the first step's batches and loss; the
    tiny recipe's first ``CP_STEPS`` losses."""
    import os

    out = {}
    for (name, hf_dir), port in zip(hf_dirs.items(), ports, strict=False):
        os.environ["MASTER_PORT"] = str(port)
        over = [*cpt(hf_dir, name), "parallel.tp=1", "parallel.cp=2", "model.cp_comm_type=p2p"]
        job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, over), output_dir=tmp_path / name)
        try:
            p = probes[name]
            with torch.no_grad():
                ours = job.chunks[0](p["x"], p["t"], p["text"], p["mask"], grids=grids(name))
                p = probes["packed"]
                packed = job.chunks[0](p["patches"], p["t"], p["text"], p["mask"], grids=p["grids"])[0]
            batches = job.schedule.microbatches(0, device=torch.device("cpu"))
            out[name] = (ours, batches, job.step()["loss"], packed)
        finally:
            job.close()
            runtime.logger.close()
    out["tiny_cp2"] = _tiny_steps(tmp_path / "tiny_cp2", port=ports[-2], overrides=["parallel.cp=2"])
    out["tiny_packed_cp2"] = _tiny_steps(tmp_path / "tiny_packed_cp2", port=ports[-1],
                                         overrides=["parallel.cp=2", *TINY_PACKED])
    return out


def _tiny_steps(out: Path, *, port: int, overrides: list[str]) -> list[float]:
    import os

    os.environ["MASTER_PORT"] = str(port)
    over = ["accelerator=cpu", "logging.console=false", f"train.steps={CP_STEPS}", *overrides]
    job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, over), output_dir=out)
    try:
        return [job.step()["loss"] for _ in range(CP_STEPS)]
    finally:
        job.close()
        runtime.logger.close()


def _tiny_steps_one_process(*, rank, world, tmp_path, ports):
    return (_tiny_steps(tmp_path / "tiny_steps_one", port=ports[0], overrides=[]),
            _tiny_steps(tmp_path / "tiny_packed_one", port=ports[1], overrides=TINY_PACKED))


def test_cp2_ring_equals_diffusers_and_one_process(tmp_path, ranks, hf_dirs, free_port):
    """Text-to-image and Edit at CP 2 with ring attention (one gloo launch): the ranks' image tokens joined equal
    diffusers' forward (<= 1e-5 relative, text padding masked), also for images of three sizes packed into one
    sequence (each against diffusers on it alone), the first loss equals the plain-torch reference around
    diffusers' model; the tiny recipe's first 5 steps at CP 2 equal one process's, also on packed variable-size
    samples."""
    from diffusers import QwenImageTransformer2DModel

    probes = {name: probe(name) for name in hf_dirs}
    probes["packed"] = packed_probe()
    got = ranks(_cp2_jobs, world=2, out=tmp_path / "cp2", tmp_path=tmp_path, hf_dirs=hf_dirs, probes=probes,
                ports=[free_port() for _ in range(len(hf_dirs) + 2)])
    one, one_packed = ranks(_tiny_steps_one_process, world=1, out=tmp_path / "one", tmp_path=tmp_path,
                            ports=[free_port(), free_port()])[0]
    p = probes["packed"]
    for name, hf_dir in hf_dirs.items():
        ref = QwenImageTransformer2DModel.from_pretrained(hf_dir).eval()
        ours = torch.cat([got[0][name][0], got[1][name][0]], dim=1)
        want = diffusers_forward(ref, probes[name], name)
        assert rel_err(ours, want) <= RTOL, (name, rel_err(ours, want))
        _, batches, loss, _ = got[0][name]
        assert got[1][name][2] == loss
        assert loss == pytest.approx(reference_loss(ref, batches), rel=RTOL), name
        with torch.no_grad():
            want = torch.cat([ref(x, p["text"][i: i + 1], p["mask"][i: i + 1], p["t"][i: i + 1],
                                  img_shapes=[[p["grids"][i]]]).sample[0] for i, x in enumerate(p["images"])])
        ours = torch.cat([got[0][name][3], got[1][name][3]])
        assert rel_err(ours, want) <= RTOL, (name, "packed", rel_err(ours, want))
    assert got[0]["tiny_cp2"] == pytest.approx(one, rel=RTOL)
    assert got[1]["tiny_cp2"] == got[0]["tiny_cp2"]
    assert got[0]["tiny_packed_cp2"] == pytest.approx(one_packed, rel=RTOL)
    assert one_packed[-1] != one_packed[0]


def _lora_export_loads_in_a_pipeline(tmp_path: Path, hf_dir: Path, p: dict) -> None:
    """The LoRA run's export (diffusers format) loads with ``QwenImagePipeline.load_lora_weights`` into a pipeline
    built from the base checkpoint, and its transformer then computes the merged export's function."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                             transformer=QwenImageTransformer2DModel.from_pretrained(hf_dir).eval())
    base = diffusers_forward(pipe.transformer, p, "t2i")
    pipe.load_lora_weights(tmp_path / "lora_peft")
    merged = diffusers_forward(QwenImageTransformer2DModel.from_pretrained(tmp_path / "lora_merged").eval(), p, "t2i")
    adapted = diffusers_forward(pipe.transformer, p, "t2i")
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


def test_preset_is_the_published_size():
    """Qwen-Image's preset holds diffusers' parameter count (20B) and its config goes both ways."""
    from diffusers import QwenImageTransformer2DModel
    from loongforge_megatron.models.qwen_image.arch import (
        PRESETS,
        QwenImageArch,
        arch_from_diffusers,
        diffusers_config,
    )

    arch = QwenImageArch(**PRESETS["qwen-image-20b"])
    cfg = {k: v for k, v in diffusers_config(arch).items() if not k.startswith("_")}
    with torch.device("meta"):
        ref = QwenImageTransformer2DModel(**cfg)
    assert arch.num_params() == sum(p.numel() for p in ref.parameters())
    assert math.isclose(arch.num_params() / 1e9, 20, rel_tol=0.05), arch.num_params()
    assert arch_from_diffusers(diffusers_config(arch)) == arch


@pytest.mark.parametrize(("overrides", "key", "fragment"), [
    (["data.height=7"], "data.height", "patches of 2"),
    (["data.seq_length=64"], "data.seq_length", "not used by Qwen-Image"),
    # NOTE: context parallelism (ring) splits the image tokens: a split that does not divide them is refused
    (["parallel.cp=2", "data.height=6", "data.width=6"], "parallel.cp", "do not split over cp"),
    (["parallel.sp=true", "parallel.tp=2", "data.packed_sizes=[[8,8]]"], "parallel.sp", "packed"),
    (["parallel.sp=true", "parallel.tp=2", "data.height=6", "data.width=6"], "parallel.sp", "do not split over tp"),
    (["data.packed_sizes=[[8,8]]", "data.reference_images=1"], "data.reference_images", "no reference images"),
    (["data.packed_sizes=[[6,6]]", "parallel.cp=2"], "data.packed_sizes", "do not split over cp"),
    (["data.packed_sizes=[[8,7]]"], "data.packed_sizes", "patches of 2"),
    (["model.ffn_hidden_size=100"], "model", "4 x hidden_size"),
])
def test_unsupported_settings_are_refused(overrides, key, fragment, capsys):
    assert main(["validate", str(RECIPE), *overrides]) == 2
    err = capsys.readouterr().err
    assert f"'{key}" in err and fragment in err and err.count("\n") == 1, err

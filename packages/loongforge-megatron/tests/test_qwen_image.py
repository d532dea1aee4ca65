"""Qwen-Image (MMDiT) on megatron-core against diffusers' QwenImageTransformer2DModel (fp32, CPU), for a
text-to-image config and an Edit config (a reference image after the noisy one, zero_cond_t): the same forward
from the same weights at TP 2, CP 2 (ring and Ulysses) and TP 2 + sequence parallelism, also on packed samples of
different sizes, the first flow-matching loss equal to a plain-torch reference calling diffusers' model, training
steps equal to one process's, diffusers -> ours (tp 2) -> diffusers bitwise online and offline, and one-line
errors.

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
            batches = job.schedule.microbatches(0, device=torch.device("cpu"))
            out[name] = (ours, batches, job.step()["loss"])
        finally:
            job.close()
            runtime.logger.close()
    out["tiny_cp2"] = _tiny_steps(tmp_path / "tiny_cp2", port=ports[-1], overrides=["parallel.cp=2"])
    return out


def _tiny_steps(out: Path, *, port: int, overrides: list[str]) -> tuple[list[float], torch.Tensor]:
    """The tiny recipe's first ``CP_STEPS`` losses and then the first block's per-head text query norm weight (held
    whole on every rank; its gradient comes through the joint attention's text queries)."""
    import os

    os.environ["MASTER_PORT"] = str(port)
    over = ["accelerator=cpu", "logging.console=false", f"train.steps={CP_STEPS}", *overrides]
    job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, over), output_dir=out)
    try:
        losses = [job.step()["loss"] for _ in range(CP_STEPS)]
        norm = next(p for n, p in job.chunks[0].named_parameters()
                    if n.endswith("layers.0.attn.added_q_layernorm.weight"))
        return losses, norm.detach().clone()
    finally:
        job.close()
        runtime.logger.close()


def _tiny_steps_one_process(*, rank, world, tmp_path, port):
    return _tiny_steps(tmp_path / "tiny_steps_one", port=port, overrides=[])


def test_cp2_ring_equals_diffusers_and_one_process(tmp_path, ranks, hf_dirs, free_port):
    """Text-to-image and Edit at CP 2 with ring attention (one gloo launch): the ranks' image tokens joined equal
    diffusers' forward (<= 1e-5 relative, text padding masked), the first loss equals the plain-torch reference
    around diffusers' model; the tiny recipe's first 5 steps at CP 2 equal one process's."""
    from diffusers import QwenImageTransformer2DModel

    probes = {name: probe(name) for name in hf_dirs}
    got = ranks(_cp2_jobs, world=2, out=tmp_path / "cp2", tmp_path=tmp_path, hf_dirs=hf_dirs, probes=probes,
                ports=[free_port() for _ in range(len(hf_dirs) + 1)])
    one = ranks(_tiny_steps_one_process, world=1, out=tmp_path / "one", tmp_path=tmp_path, port=free_port())[0]
    for name, hf_dir in hf_dirs.items():
        ref = QwenImageTransformer2DModel.from_pretrained(hf_dir).eval()
        ours = torch.cat([got[0][name][0], got[1][name][0]], dim=1)
        want = diffusers_forward(ref, probes[name], name)
        assert rel_err(ours, want) <= RTOL, (name, rel_err(ours, want))
        _, batches, loss = got[0][name]
        assert got[1][name][2] == loss
        assert loss == pytest.approx(reference_loss(ref, batches), rel=RTOL), name
    assert got[0]["tiny_cp2"][0] == pytest.approx(one[0], rel=RTOL)
    assert got[1]["tiny_cp2"][0] == got[0]["tiny_cp2"][0]


PACKED_SIZES = [(6, 8), (4, 4), (2, 8)]  # latent sizes of the packed probe: 12 + 4 + 4 tokens, cut by 2 ranks in the first
CPT_PACKED = ["data.packed_sizes=[[4,4],[4,8]]"]  # NOTE: 4 or 8 tokens an image: any packing splits over cp 2 or tp 2
TINY_PACKED = ["data.packed_sizes=[[8,8],[4,8],[4,4]]"]
#: the packed layouts of one launch: (name, parallel overrides)
PACKED_LAYOUTS = (("p2p", ["parallel.tp=1", "parallel.cp=2", "model.cp_comm_type=p2p"]),
                  ("a2a", ["parallel.tp=1", "parallel.cp=2", "model.cp_comm_type=a2a"]),
                  ("sp", ["parallel.tp=2", "parallel.sp=true"]))


def packed_probe(references: int) -> dict:
    """Three samples of different sizes (each with ``references`` reference images of its size) with their own
    noise levels and texts (one padded): each alone (diffusers' input: its noisy image's tokens, then its
    references') and packed (ours: the samples' tokens joined, one grid row per image)."""
    g = torch.Generator().manual_seed(5)
    images = [torch.randn(1, (1 + references) * (h // 2) * (w // 2), 16, generator=g) for h, w in PACKED_SIZES]
    mask = torch.ones(len(images), TEXT, dtype=torch.bool)
    mask[1, 2:] = False
    shapes = [[(1, h // 2, w // 2)] * (1 + references) for h, w in PACKED_SIZES]
    return {"images": images, "t": torch.tensor([0.1, 0.7315, 0.5]), "mask": mask, "shapes": shapes,
            "text": torch.randn(len(images), TEXT, 16, generator=g), "patches": torch.cat([i[0] for i in images]),
            "grids": [g for s in shapes for g in s]}


def packed_diffusers_forward(model, p: dict) -> torch.Tensor:
    """diffusers' model on each sample of a packed probe alone, the outputs joined."""
    with torch.no_grad():
        return torch.cat([model(x, p["text"][i: i + 1], p["mask"][i: i + 1], p["t"][i: i + 1],
                                img_shapes=[p["shapes"][i]]).sample[0] for i, x in enumerate(p["images"])])


def packed_reference_loss(model, batches: list[dict]) -> float:
    """:func:`reference_loss` of packed micro-batches, each sample through diffusers' model alone: its noisy
    image's tokens x_t = (1 - s) x0 + s noise, then its reference images' (clean) tokens."""
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            rows = [tuple(int(v) for v in g) for g in b["grid"].tolist()]
            n = len(b["sigmas"])
            per = len(rows) // n
            at, at_ref = 0, 0
            for i in range(n):
                shapes = rows[i * per:(i + 1) * per]
                main, refs = math.prod(shapes[0]), sum(math.prod(g) for g in shapes[1:])
                x0, noise = b["x0"][at:at + main][None], b["noise"][at:at + main][None]
                s = b["sigmas"][i]
                inp = (1 - s) * x0 + s * noise
                if refs:
                    inp = torch.cat([inp, b["reference"][at_ref:at_ref + refs][None]], dim=1)
                pred = model(inp, b["text"][i: i + 1], b["text_mask"][i: i + 1], b["sigmas"][i: i + 1],
                             img_shapes=[shapes]).sample
                err = (pred[:, :main] - (noise - x0)).pow(2)
                total, count = total + float(err.sum()), count + err.numel()
                at, at_ref = at + main, at_ref + refs
    return total / count


def _packed_jobs(*, rank, world, tmp_path, hf_dirs, probes, ports):
    """Packed samples in each layout of ``PACKED_LAYOUTS`` (Edit: a reference image after each noisy one): this
    rank's share of the packed forward and of the unpacked probe's, the first step's loss on packed Edit samples;
    the tiny recipe's first ``CP_STEPS`` losses on packed variable-size samples."""
    import os

    out = {}
    for (layout, parallel), port in zip(PACKED_LAYOUTS, ports, strict=False):
        os.environ["MASTER_PORT"] = str(port)
        over = [*cpt(hf_dirs["edit"], "edit"), *parallel, *CPT_PACKED]
        job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, over), output_dir=tmp_path / layout)
        try:
            p, q = probes["packed"], probes["edit"]
            with torch.no_grad():
                packed = job.chunks[0](p["patches"], p["t"], p["text"], p["mask"], grids=p["grids"])[0]
                unpacked = job.chunks[0](q["x"], q["t"], q["text"], q["mask"], grids=grids("edit"))
            out[layout] = (packed, unpacked, job.step()["loss"])
        finally:
            job.close()
            runtime.logger.close()
    for (layout, parallel), port in zip(PACKED_LAYOUTS, ports[len(PACKED_LAYOUTS):], strict=True):
        out[f"tiny_{layout}"] = _tiny_steps(tmp_path / f"tiny_{layout}", port=port, overrides=[*parallel, *TINY_PACKED])
    return out


def _packed_one_process(*, rank, world, tmp_path, hf_dirs, ports):
    """One process: each config's first step on packed samples (its batches and loss), the tiny recipe's first
    ``CP_STEPS`` losses on packed variable-size samples."""
    import os

    out = {}
    for (name, hf_dir), port in zip(hf_dirs.items(), ports, strict=False):
        os.environ["MASTER_PORT"] = str(port)
        over = [*cpt(hf_dir, name), "parallel.tp=1", *CPT_PACKED]
        job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, over), output_dir=tmp_path / f"one_{name}")
        try:
            batches = job.schedule.microbatches(0, device=torch.device("cpu"))
            out[name] = (batches, job.step()["loss"])
        finally:
            job.close()
            runtime.logger.close()
    out["tiny"] = _tiny_steps(tmp_path / "tiny_packed_one", port=ports[-1], overrides=TINY_PACKED)
    return out


def test_packed_at_cp2_and_tp2_sp_equal_diffusers_and_one_process(tmp_path, ranks, hf_dirs, free_port):
    """Samples of different sizes packed into one sequence, over 2 ranks (the cut falls inside a sample): at CP 2
    with the ring and with Ulysses and at TP 2 + sequence parallelism, Edit samples (a reference image after each
    noisy one) give diffusers' forward on each sample alone (<= 1e-5 relative), Ulysses also on the unpacked probe,
    and the first loss on packed Edit samples equals one process's; in one process the first loss on packed
    samples equals the plain-torch reference around diffusers' model, sample by sample (text-to-image and Edit);
    the tiny recipe on packed variable-size samples gives the one-process losses over 5 steps in each layout."""
    from diffusers import QwenImageTransformer2DModel

    probes = {"packed": packed_probe(references=1), "edit": probe("edit")}
    got = ranks(_packed_jobs, world=2, out=tmp_path / "two", tmp_path=tmp_path, hf_dirs=hf_dirs, probes=probes,
                ports=[free_port() for _ in range(2 * len(PACKED_LAYOUTS))])
    one = ranks(_packed_one_process, world=1, out=tmp_path / "one", tmp_path=tmp_path, hf_dirs=hf_dirs,
                ports=[free_port() for _ in range(len(hf_dirs) + 1)])[0]
    refs = {name: QwenImageTransformer2DModel.from_pretrained(d).eval() for name, d in hf_dirs.items()}
    want = packed_diffusers_forward(refs["edit"], probes["packed"])
    want_unpacked = diffusers_forward(refs["edit"], probes["edit"], "edit")
    for layout, _ in PACKED_LAYOUTS:
        # NOTE: a CP rank returns its tokens; sequence parallelism gathers the TP ranks' for the loss
        if layout == "sp":
            ours, unpacked = got[0][layout][:2]
        else:
            ours = torch.cat([got[0][layout][0], got[1][layout][0]])
            unpacked = torch.cat([got[0][layout][1], got[1][layout][1]], dim=1)
        assert rel_err(ours, want) <= RTOL, (layout, rel_err(ours, want))
        assert rel_err(unpacked, want_unpacked) <= RTOL, (layout, rel_err(unpacked, want_unpacked))
        assert got[0][layout][2] == pytest.approx(one["edit"][1], rel=RTOL), layout
        losses, norm = got[0][f"tiny_{layout}"]
        # NOTE: Adam's updates of the weight (from 1)
        assert rel_err(norm - 1, one["tiny"][1] - 1) <= 1e-4, (layout, rel_err(norm - 1, one["tiny"][1] - 1))
        assert losses == pytest.approx(one["tiny"][0], rel=RTOL), layout
        assert got[1][f"tiny_{layout}"][0] == losses
    for name, ref in refs.items():
        batches, loss = one[name]
        assert "grid" in batches[0] and ("reference" in batches[0]) == (name == "edit"), name
        assert loss == pytest.approx(packed_reference_loss(ref, batches), rel=RTOL), name
    assert one["tiny"][0][-1] != one["tiny"][0][0]


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
    (["parallel.sp=true", "parallel.tp=2", "parallel.cp=2", "data.packed_sizes=[[4,6]]"], "data.packed_sizes",
     "do not split over cp x tp"),
    # NOTE: Ulysses trades the image tokens' split for a head split: 4 heads do not split over tp x cp = 8
    (["parallel.tp=2", "parallel.cp=4", "model.cp_comm_type=a2a", "train.global_batch_size=4",
      "train.micro_batch_size=4"], "parallel.cp", "heads do not split over tp x cp"),
    (["parallel.sp=true", "parallel.tp=2", "data.height=6", "data.width=6"], "parallel.sp", "do not split over tp"),
    (["data.packed_sizes=[[6,6]]", "parallel.cp=2"], "data.packed_sizes", "do not split over cp"),
    (["data.packed_sizes=[[8,7]]"], "data.packed_sizes", "patches of 2"),
    (["model.ffn_hidden_size=100"], "model", "4 x hidden_size"),
])
def test_unsupported_settings_are_refused(overrides, key, fragment, capsys):
    assert main(["validate", str(RECIPE), *overrides]) == 2
    err = capsys.readouterr().err
    assert f"'{key}" in err and fragment in err and err.count("\n") == 1, err

"""Delta-FP8 FSDP2 all-gather: the blockwise E4M3 codec, no error accumulation against the reconstruction, and
the hook itself on 2 gloo processes (ranks of the workspace harness, tests/support/rank_harness.py).

Tolerances: codec per element ``|err| <= max(|x|/16, scale/1024)`` (E4M3: 3 mantissa bits, subnormal step
2^-9 of the block scale); training loss of the tiny policy within 0.5 % of the bf16-all-gather run at every step.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "embodied" / "tiny_vla_synthetic.yaml"
STEPS, REPRIME = 20, 8
RUN = ["parallel.strategy=fsdp2", "train.precision=bf16", f"train.steps={STEPS}", "checkpoint.resume=never",
       "checkpoint.save_at_end=false", "logging.console=false", "logging.tensorboard=false"]


# ----------------------------------------------------------------------------------------------- codec
@pytest.mark.parametrize("numel", [1, 255, 256, 257, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_round_trip_error_bound(numel, dtype):
    from loongforge_embodied.fp8_allgather import BLOCK, dequantize_blockwise, quantize_blockwise

    g = torch.Generator().manual_seed(numel)
    # Blocks of very different magnitude, plus exact zeros and values far below their block's amax.
    mag = 10.0 ** torch.randint(-6, 4, (numel,), generator=g).float()
    x = (torch.randn(numel, generator=g) * mag).to(dtype)
    x[::7] = 0
    q, scales = quantize_blockwise(x)
    nb = -(-numel // BLOCK)
    assert q.dtype == torch.float8_e4m3fn and q.numel() == nb * BLOCK and scales.shape == (nb,)
    dq = dequantize_blockwise(q, scales, numel=numel)
    xf = x.float()
    per_elem_scale = scales.repeat_interleave(BLOCK)[:numel]
    bound = torch.maximum(xf.abs() / 16, per_elem_scale / 1024) * (1 + 1e-5)
    assert ((dq - xf).abs() <= bound).all()
    assert (dq[xf == 0] == 0).all()
    # amax of every block is kept to within one E4M3 rounding.
    amax = torch.nn.functional.pad(xf.abs(), (0, nb * BLOCK - numel)).view(nb, BLOCK).amax(1)
    assert torch.allclose(scales * 448, amax.clamp_min(torch.finfo(torch.float32).tiny), rtol=1e-6)


def test_all_zero_block_is_exact():
    from loongforge_embodied.fp8_allgather import dequantize_blockwise, quantize_blockwise

    q, s = quantize_blockwise(torch.zeros(600))
    assert torch.equal(dequantize_blockwise(q, s, numel=600), torch.zeros(600))


def test_delta_against_reconstruction_does_not_drift():
    """200 Adam-sized updates of an fp32 master; bf16 values gathered as FP8 deltas. Against the reconstruction
    the error stays at one step's rounding; against the last true value it accumulates."""
    from loongforge_embodied.fp8_allgather import dequantize_blockwise, quantize_blockwise

    def send(delta: torch.Tensor) -> torch.Tensor:
        q, s = quantize_blockwise(delta)
        return dequantize_blockwise(q, s, numel=delta.numel())

    g = torch.Generator().manual_seed(0)
    n = 8192
    master = torch.randn(n, generator=g) * 0.02
    x = master.to(torch.bfloat16)
    recon, naive, prev = x.clone(), x.clone(), x.clone()
    worst_step = torch.zeros(())
    for _ in range(200):
        master += 1e-3 * torch.randn(n, generator=g)
        x = master.to(torch.bfloat16)
        delta = x.float() - recon.float()
        worst_step = torch.maximum(worst_step, delta.abs().max() / 16)
        recon = (recon.float() + send(delta)).to(torch.bfloat16)
        naive = (naive.float() + send(x.float() - prev.float())).to(torch.bfloat16)
        prev = x
    err = (recon.float() - x.float()).abs()
    drift = (naive.float() - x.float()).abs()
    ulp = torch.finfo(torch.bfloat16).eps * x.float().abs()
    # One step's FP8 rounding of the delta, plus bf16 rounding of the reconstruction.
    assert (err <= worst_step + ulp).all(), (err.max(), worst_step)
    assert drift.mean() > 8 * err.mean(), (drift.mean(), err.mean())
    assert drift.max() > 4 * err.max(), (drift.max(), err.max())


@pytest.mark.parametrize("numel", [1, 255, 257, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_codec_is_the_fused_kernels_reference(numel, dtype):
    """The torch encode / decode here and ``loongforge_kernels``' references (which its Triton kernels match
    bit for bit, tests/test_fp8_delta.py there) give the same bytes: the CUDA path is interchangeable."""
    from loongforge_embodied.fp8_allgather import _apply_deltas, _encode_delta
    from loongforge_kernels.references import apply_fp8_deltas_ref, encode_fp8_delta_ref

    g = torch.Generator().manual_seed(numel)
    mag = 10.0 ** torch.randint(-42, 30, (2, numel), generator=g).float()
    x, ref = (torch.randn(2, numel, generator=g) * mag).to(dtype)
    ref[::3] = x[::3]
    payload = _encode_delta(x, ref)
    assert torch.equal(payload, encode_fp8_delta_ref(x, ref))
    recon = torch.stack([ref, x])
    gathered = torch.stack([payload, _encode_delta(ref, x)])
    a, b = recon.clone(), recon.clone()
    _apply_deltas(a, gathered)
    apply_fp8_deltas_ref(b, gathered)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_fused_codec_only_on_cuda():
    """auto: the triton provider's fused codec on CUDA; on the CPU (no interpreter) the torch reference."""
    from loongforge_embodied.fp8_allgather import delta_hook
    from loongforge_kernels import fp8_delta

    cpu = delta_hook(device_type="cpu")
    assert cpu.encode.func is fp8_delta.encode_fp8_delta and cpu.encode.keywords == {"impl": "torch"}
    cuda = delta_hook(device_type="cuda")
    assert cuda.encode.func is fp8_delta.encode_fp8_delta and cuda.encode.keywords == {"impl": "triton"}
    assert cuda.apply.func is fp8_delta.apply_fp8_deltas and cuda.apply.keywords == {"impl": "triton"}


# ----------------------------------------------------------------------------------------------- recipe
def test_recipe_rejects_fp8_allgather_without_fsdp2():
    from loongforge.errors import RecipeError
    from loongforge.recipe import load_recipe
    from loongforge_embodied.backend import EmbodiedBackend

    with pytest.raises(RecipeError) as err:  # checked at load time
        load_recipe(RECIPE, ["parallel.strategy=ddp", "model.fp8_allgather.enabled=true"])
    assert err.value.key == "model.fp8_allgather.enabled"
    EmbodiedBackend().validate(load_recipe(RECIPE, [*RUN, "model.fp8_allgather.enabled=true"]), world_size=2)


# ----------------------------------------------------------------------------------------------- FSDP2 hook
@pytest.mark.slow
def test_fsdp2_hook_on_gloo(tmp_path, env, ranks):
    # NOTE: the timeout is the deadlock watchdog: a hung collective fails the test with every rank's stack.
    r = ranks(_driver, world=2, out=tmp_path, env=env, timeout_s=300)[0]

    # The recipe path refuses CPU and names the key.
    assert r["cpu_error_key"] == "model.fp8_allgather.enabled" and "CUDA" in r["cpu_error"], r["cpu_error"]
    # Every unsharded parameter is exactly the reconstruction, identical on both ranks, and within FP8
    # rounding of the true (bf16-cast) parameter.
    assert r["params_equal_recon"] and r["recon_same_on_ranks"]
    assert r["recon_vs_true_max"] <= r["true_absmax"] / 16
    # Loss within 0.5 % of the bf16 all-gather run at every step.
    rel = [abs(a - b) / abs(b) for a, b in zip(r["fp8"]["losses"], r["bf16"]["losses"], strict=True)]
    assert max(rel) <= 5e-3, rel
    # Re-priming: one full gather per group at the start and after steps 8 and 16.
    fp8 = r["fp8"]["stats"]
    assert fp8["primes"] == r["groups"] * (1 + (STEPS - 1) // REPRIME)
    # Bytes: (1 + 4/256) / 2 per element plus padding each rank's slab to whole blocks (up to 1.2 % here: the
    # tiny policy's slabs are ~10k elements; negligible for real ones).
    assert fp8["steady_ratio"] <= (1 + 4 / 256) / 2 + r["max_pad"] + 1e-9
    assert r["bf16"]["stats"]["ratio"] == 1.0
    print(f"\nlosses bf16 {r['bf16']['losses'][-1]:.5f} fp8 {r['fp8']['losses'][-1]:.5f} max rel {max(rel):.2e}; "
          f"bytes ratio {fp8['ratio']:.4f} (steady {fp8['steady_ratio']:.4f}); "
          f"|R - true| {r['recon_vs_true_max']:.2e} of |x| {r['true_absmax']:.2e}")


def _stats(hook) -> dict:
    s = hook.stats
    return {"calls": s.calls, "primes": s.primes, "bytes_baseline": s.bytes_baseline, "bytes_sent": s.bytes_sent,
            "ratio": s.ratio, "steady_ratio": s.steady_ratio}


def _check_recon(job, hook) -> dict:
    """Unshard every group once more (a delta gather) and compare the unsharded params with the reconstruction.
    NOTE: reads FSDP2 internals (the param group's layout), in this test only."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in job.model.module.modules() if isinstance(m, FSDPModule)]
    equal, same, err, absmax, pad = True, True, 0.0, 0.0, 0.0
    for m, g in zip(modules, hook.groups, strict=True):
        m.unshard()
        pg = m._get_fsdp_state()._fsdp_param_group
        world = pg._all_gather_process_group.size()
        rows = g.recon.view(world, -1)
        n = rows.shape[1]
        pad = max(pad, (-(-n // 256) * 256 - n) / (2 * n))
        ref = g.recon.clone()
        dist.broadcast(ref, src=0)
        same &= torch.equal(ref, g.recon)
        off = 0
        for p in pg.fsdp_params:
            shard = p.padded_sharded_param_size.numel()
            full = rows[:, off:off + shard].reshape(-1)[:p._orig_size.numel()].view(p._orig_size)
            equal &= torch.equal(full, p.unsharded_param.detach())
            true = p.sharded_param.full_tensor().to(full.dtype).float()
            err = max(err, (full.float() - true).abs().max().item())
            absmax = max(absmax, true.abs().max().item())
            off += shard
        m.reshard()
    return {"params_equal_recon": bool(equal), "recon_same_on_ranks": bool(same), "recon_vs_true_max": err,
            "true_absmax": absmax, "groups": len(modules), "max_pad": pad}


def _driver(*, rank: int, world: int) -> dict:
    import torch.distributed as dist
    from loongforge.api import build_job, load_recipe
    from loongforge.errors import RecipeError
    from loongforge_embodied.fp8_allgather import _install, delta_hook, meter_allgather

    dist.init_process_group("gloo")
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            build_job(load_recipe(RECIPE, [*RUN, "model.fp8_allgather.enabled=true"]), output_dir=tmp)
        except RecipeError as e:
            res["cpu_error"], res["cpu_error_key"] = str(e), e.key
    for name in ("bf16", "fp8"):
        with tempfile.TemporaryDirectory() as tmp:
            job, _ = build_job(load_recipe(RECIPE, RUN), output_dir=tmp)
            # NOTE: the recipe path refuses CPU; the test installs the hook itself (no FP8 hardware check).
            hook = (_install(job.model.module, delta_hook(device_type="cpu", reprime_every=REPRIME))
                    if name == "fp8" else meter_allgather(job.model.module))
            job.model.allgather = hook  # the job calls hook.step() after each optimizer step
            losses = [job.step()["loss"] for _ in range(STEPS)]
            res[name] = {"losses": losses, "stats": _stats(hook)}
            if name == "fp8":
                res.update(_check_recon(job, hook))
            job.close()
    dist.destroy_process_group()
    return res

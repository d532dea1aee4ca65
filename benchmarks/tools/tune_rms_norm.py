"""Sweep the RMSNorm kernels' launch shape on this GPU (rows per tile, backward programs per SM).

Prints forward + backward time per setting next to torch.compile of the reference, timed two ways: plain
``do_bench`` (CPU launch overhead included) and ``do_bench_cudagraph`` (GPU time only).

    PYTHONPATH=packages/loongforge-kernels/src python3 benchmarks/tools/tune_rms_norm.py
"""

from __future__ import annotations

import importlib
import itertools

import torch
import triton.testing as tt
from loongforge_kernels import references as ref

rn = importlib.import_module("loongforge_kernels.rms_norm")  # the module (the package exports the function)


def fwd_bwd(fn, x, w, dy):
    def run():
        x.grad = w.grad = None
        fn(x, w).backward(dy)

    return run


def timed(run) -> tuple[float, float]:
    plain = tt.do_bench(run, warmup=50, rep=300)
    with torch.cuda.stream(torch.cuda.Stream()):
        graph = tt.do_bench_cudagraph(run, rep=300)
    return plain, graph


def main() -> None:
    compiled = torch.compile(lambda x, w: ref.rms_norm_ref(x, w, 1e-6), dynamic=False)
    for tokens, hidden in ((16384, 2048), (16384, 4096), (32768, 2048)):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.rand(hidden, device="cuda") + 0.5).requires_grad_()
        dy = torch.randn_like(x)
        gb = 5 * tokens * hidden * 2 / 1e9
        p, g = timed(fwd_bwd(compiled, x, w, dy))
        print(f"{tokens}x{hidden} compile: {p:.3f} ms plain, {g:.3f} ms graph ({gb / g * 1e3:.0f} GB/s)", flush=True)
        for tile_f, tile_b, per_sm in itertools.product((2048, 4096, 8192), (2048, 4096, 8192), (2, 4, 8)):
            rn.TILE.update(fwd=tile_f, bwd=tile_b)
            rn.BWD_PROGRAMS_PER_SM = per_sm
            p, g = timed(fwd_bwd(lambda a, b: rn.rms_norm(a, b, 1e-6, impl="triton"), x, w, dy))
            print(f"  tile fwd {tile_f} bwd {tile_b} progs/SM {per_sm}: {p:.3f} ms plain, {g:.3f} ms graph "
                  f"({gb / g * 1e3:.0f} GB/s)", flush=True)


if __name__ == "__main__":
    main()

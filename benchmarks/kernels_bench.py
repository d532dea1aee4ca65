"""Fused-kernel benchmark: loongforge_kernels vs torch eager, torch.compile and (when installed) Liger-Kernel.

Each kernel runs forward + backward at Llama-3.2-1B / 8B training shapes (sparse MLA at DeepSeek-V3.2's).
Printed per row: time, effective GB/s (memory-bound kernels, counting the minimal bytes) or TFLOP/s (fused
linear CE, sparse MLA), peak memory above the inputs, and the max abs error vs the eager reference (fp32 math);
the ratios come last.

    python3 benchmarks/kernels_bench.py [--quick] [--only rms_norm,swiglu,rope,flce,moe,sparse_mla] [--no-compile] \
        [--out report.md]
    python3 benchmarks/kernels_bench.py --smoke    # CPU (Triton's interpreter), tiny shapes: checks the script

Every row is appended to ``benchmarks/results/kernels_bench.md`` with the date and hardware (``--results DIR``
elsewhere; a ``--smoke`` run records only when ``--results`` is given).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

if "--smoke" in sys.argv[1:] and os.environ.get("TRITON_INTERPRET") != "1":
    # NOTE: on CPU the Triton kernels run only under Triton's interpreter, which it reads when kernels are defined
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "TRITON_INTERPRET": "1"})

import harness  # noqa: E402
import loongforge_kernels as lk  # noqa: E402
import torch  # noqa: E402
from loongforge_kernels import references as ref  # noqa: E402
from loongforge_kernels.cross_entropy import fused_linear_cross_entropy  # noqa: E402
from loongforge_kernels.moe_permute import MoEPermuteFunction, MoEUnpermuteFunction  # noqa: E402


@dataclass
class Case:
    """One kernel at one shape: inputs, implementations by name, and the work it does."""

    kernel: str
    shape: str
    inputs: Callable[[], list[torch.Tensor]]
    impls: dict[str, Callable[..., torch.Tensor]]
    bytes: float = 0.0
    flops: float = 0.0
    rows: list[dict] = field(default_factory=list)


def _liger():
    try:
        import liger_kernel.transformers.functional as lf

        return lf
    except Exception:  # not installed, or broken against this torch: skip its columns
        return None


def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def cases(device: str, *, quick: bool, compile_: bool, only: set[str], flce_variants: bool = False) -> list[Case]:
    bf16 = torch.bfloat16
    lf = _liger()
    out: list[Case] = []

    def add(kernel, shape, inputs, ours, eager, *, liger=None, tilelang=None, nbytes=0.0, flops=0.0, variants=None):
        if only and kernel not in only:
            return
        impls = {"loongforge": ours, **(variants or {}), "eager": eager}
        if compile_:
            impls["compile"] = _compiled(eager)
        if liger is not None:
            impls["liger"] = liger
        if tilelang is not None:
            impls["tilelang"] = tilelang
        out.append(Case(kernel, shape, inputs, impls, nbytes, flops))

    tokens = 256 if quick else 16384
    for hidden in (2048, 4096) if not quick else (1000,):
        add(
            "rms_norm",
            f"{tokens}x{hidden} bf16, fp32 w",
            lambda h=hidden: [
                torch.randn(tokens, h, device=device, dtype=bf16),
                torch.rand(h, device=device) + 0.5,
            ],
            lambda x, w: lk.rms_norm(x, w, 1e-6, impl="triton"),
            lambda x, w: ref.rms_norm_ref(x, w, 1e-6),
            liger=(lambda x, w: lf.liger_rms_norm(x, w, 1e-6)) if lf else None,
            nbytes=5 * tokens * hidden * 2,
        )
    for ffn in (8192, 14336) if not quick else (1000,):
        add(
            "swiglu",
            f"{tokens}x2*{ffn} bf16",
            lambda f=ffn: [torch.randn(tokens, 2 * f, device=device, dtype=bf16)],
            lambda x: lk.swiglu(x, impl="triton"),
            ref.swiglu_ref,
            liger=(lambda x: lf.liger_swiglu(*x.chunk(2, -1)))
            if lf and hasattr(lf, "liger_swiglu")
            else None,
            nbytes=8 * tokens * ffn * 2,
        )
    s, b, h, d = (8192, 2, 32, 128) if not quick else (16, 2, 4, 32)
    freqs = torch.rand(s, 1, 1, d, device=device) * 100
    add(
        "rope",
        f"sbhd {s}x{b}x{h}x{d} bf16",
        lambda: [torch.randn(s, b, h, d, device=device, dtype=bf16)],
        lambda x: lk.apply_rope(x, freqs, impl="triton"),
        lambda x: ref.rope_ref(x, freqs),
        nbytes=4 * s * b * h * d * 2,
    )
    cu = torch.tensor([0, s // 3, s, s + 7, 2 * s], device=device, dtype=torch.int32)
    add(
        "rope",
        f"thd {2 * s}x{h}x{d} bf16, 4 seqs",
        lambda: [torch.randn(2 * s, h, d, device=device, dtype=bf16)],
        lambda x: lk.apply_rope(x, freqs, cu_seqlens=cu, impl="triton"),
        lambda x: ref.rope_ref(x, freqs, cu_seqlens=cu),
        nbytes=4 * s * b * h * d * 2,
    )
    vocab = 128256 if not quick else 1000
    for n_tok, hidden in ((8192, 2048), (8192, 4096), (16384, 4096)) if not quick else ((64, 48),):
        labels = torch.randint(0, vocab, (n_tok,), device=device)
        add(
            "flce",
            f"{n_tok}x{hidden} -> V {vocab} bf16",
            lambda hd=hidden, n=n_tok: [
                torch.randn(n, hd, device=device, dtype=bf16),
                torch.randn(vocab, hd, device=device, dtype=bf16) / math.sqrt(hd),
            ],
            lambda x, w, lab=labels: fused_linear_cross_entropy(x, w, lab, impl="triton"),
            lambda x, w, lab=labels: ref.linear_cross_entropy_ref(x, w, lab),
            liger=(lambda x, w, lab=labels: lf.liger_fused_linear_cross_entropy(x, w, lab)) if lf else None,
            flops=6 * n_tok * hidden * vocab,
            # A/B of the chunk schedule: one chunk of N tokens instead of the default two of N/2
            variants={
                "lf-chunk-N": lambda x, w, lab=labels, n=n_tok: fused_linear_cross_entropy(
                    x, w, lab, impl="triton", chunk_size=n),
            } if flce_variants else None,
        )
    n_tok, n_exp, topk = (16384, 64, 8) if not quick else (32, 8, 2)
    idx = torch.rand(n_tok, n_exp, device=device).topk(topk, dim=-1).indices
    row_id = ref.moe_row_id_map(idx)
    probs = torch.rand(n_tok, topk, device=device).softmax(-1)
    for hidden in (2048, 4096) if not quick else (100,):
        add(
            "moe_permute",
            f"T {n_tok} H {hidden} E {n_exp} k {topk} bf16",
            lambda hd=hidden, n=n_tok: [torch.randn(n, hd, device=device, dtype=bf16)],
            lambda x: MoEPermuteFunction.apply(x, row_id),
            lambda x: ref.moe_permute_ref(x, row_id),
            nbytes=2 * (1 + topk) * n_tok * hidden * 2,
        )
        add(
            "moe_unpermute",
            f"T {n_tok} H {hidden} E {n_exp} k {topk} bf16",
            lambda hd=hidden, n=n_tok: [torch.randn(n * topk, hd, device=device, dtype=bf16), probs.clone()],
            lambda x, p: MoEUnpermuteFunction.apply(x, row_id, p),
            lambda x, p: ref.moe_unpermute_ref(x, row_id, p),
            nbytes=(2 + 3 * topk) * n_tok * hidden * 2,
        )
    # DeepSeek-V3.2 DSA: 64 heads over one latent kv (512 + 64 rope), 2048 keys per query. The eager reference
    # gathers [T, topk, 576] fp32 rows and keeps them for backward: ~72 GiB peak at this shape (measured on
    # CPU at T 32 and scaled), so it fits an H200 at full size. Random distinct indices, all valid (as
    # FlashMLA's benchmark), so every counted FLOP is done; TFLOP/s counts fwd 2*T*H*topk*(D + d_v) and
    # bwd twice that (the recomputed QK^T not counted).
    t_s, h_s, k_s, dv_s, dr_s = (4096, 64, 2048, 512, 64) if not quick else (64, 4, 24, 32, 16)
    if not only or "sparse_mla" in only:
        from loongforge_kernels.tilelang_sparse_mla import tilelang_unavailable_reason

        idx_s = lk.dsa_topk_indices(torch.rand(t_s, t_s, device=device), k_s, causal=False)
        # the TileLang kernels are a second GPU implementation of the op (optional tilelang, SM >= 9.0)
        tl_reason = tilelang_unavailable_reason(device)
        if tl_reason:
            print(f"sparse_mla: tilelang row skipped: {tl_reason}", flush=True)
        add(
            "sparse_mla",
            f"T {t_s} H {h_s} topk {k_s} D {dv_s}+{dr_s} bf16",
            lambda: [
                torch.randn(t_s, h_s, dv_s + dr_s, device=device, dtype=bf16),
                torch.randn(t_s, 1, dv_s + dr_s, device=device, dtype=bf16),
            ],
            lambda q, kv: lk.sparse_mla_attention(q, kv, idx_s, None, dv_s, impl="triton"),
            lambda q, kv: ref.sparse_mla_ref(q, kv, idx_s, None, dv_s),
            tilelang=None
            if tl_reason
            else (lambda q, kv: lk.sparse_mla_attention(q, kv, idx_s, None, dv_s, impl="tilelang")),
            flops=6 * t_s * h_s * k_s * (dv_s + dr_s + dv_s),
        )
    return out


REP_MS = 60  # do_bench's time budget per measurement (--rep): a 40 ms step gets only ~2 samples at 60
CPU_REPS = 3  # timed calls per measurement on CPU (--smoke: 1; Triton's interpreter takes seconds per call)


def _timer(step: Callable[[], None], device: str) -> float:
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(step, warmup=10, rep=REP_MS, return_mode="median")
    step()
    t0 = time.perf_counter()
    for _ in range(CPU_REPS):
        step()
    return (time.perf_counter() - t0) / CPU_REPS * 1e3


def _graph_timer(step: Callable[[], None], device: str) -> float | None:
    """GPU time alone: the fwd+bwd replayed as one CUDA graph (no Python / launch overhead); None if the
    step cannot be captured."""
    if device != "cuda":
        return None
    import triton.testing

    try:
        with torch.cuda.stream(torch.cuda.Stream()):
            return triton.testing.do_bench_cudagraph(step, rep=max(100, REP_MS), return_mode="median")
    except Exception:  # e.g. a peer that syncs with the host inside its step
        torch.cuda.synchronize()
        return None


def _upstream(out: torch.Tensor, device: str) -> torch.Tensor:
    """The grad fed to ``out.backward``: random for tensor outputs; 1 for a scalar loss, as ``loss.backward()``
    passes in training (fused CE skips rescaling its stored grads then; eager and compile fold it for free)."""
    if out.dim() == 0:
        return torch.ones((), device=device)
    return torch.randn(out.shape, device=device, generator=torch.Generator(device).manual_seed(0))


def run_case(case: Case, device: str) -> None:
    base_inputs = case.inputs()
    results = {}
    # the ground truth: the eager reference on fp32 copies of the inputs
    ref_leaves = [x.detach().float().requires_grad_(True) for x in base_inputs]
    ref_out = case.impls["eager"](*ref_leaves)
    g_ref = _upstream(ref_out, device)
    ref_out.backward(g_ref)
    truth = [ref_out.detach()] + [x.grad for x in ref_leaves]
    del ref_out, ref_leaves
    for name, fn in case.impls.items():
        leaves = [x.detach().clone().requires_grad_(True) for x in base_inputs]
        try:
            out = fn(*leaves)
            g = _upstream(out, device).to(out.dtype)
            out.backward(g)
            results[name] = [out.detach()] + [x.grad for x in leaves]

            def step(fn=fn, leaves=leaves, g=g):
                for x in leaves:
                    x.grad = None
                fn(*leaves).backward(g)

            for x in leaves:
                x.grad = None
            del out
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
            else:
                step()
                peak = 0
            ms = _timer(step, device)
            # NOTE: only our kernels and compile are replayed as graphs: a peer that syncs with the host inside
            # its step (Liger's fused CE) fails capture and leaves the CUDA RNG in capture state.
            gpu_ms = (_graph_timer(step, device)
                      if name in ("loongforge", "compile", "tilelang") or name.startswith("lf-") else None)
        except Exception as exc:  # one failing peer must not hide the others
            case.rows.append(
                {"impl": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"}
            )
            continue
        rate = case.flops / ms / 1e9 if case.flops else case.bytes / ms / 1e6
        case.rows.append(
            {"impl": name, "ms": ms, "gpu_ms": gpu_ms, "rate": rate, "peak_mib": peak / 2**20, "err": 0.0}
        )
        del leaves
        if device == "cuda":
            torch.cuda.empty_cache()

    for row in case.rows:  # max abs error of the output and every input grad vs the fp32 truth
        if "error" not in row:
            pairs = zip(results[row["impl"]], truth, strict=True)
            row["err"] = max((a.float() - b.float()).abs().max().item() for a, b in pairs)


def report(all_cases: list[Case], device_name: str) -> str:
    lines = [f"# loongforge_kernels fwd+bwd on {device_name}", "", f"torch {torch.__version__}", ""]
    lines += [
        "| kernel | shape | impl | ms | GPU ms (graph) | GB/s or TFLOP/s | peak MiB | max err vs fp32 ref |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for c in all_cases:
        unit = "TFLOP/s" if c.flops else "GB/s"
        for r in c.rows:
            if "error" in r:
                lines.append(f"| {c.kernel} | {c.shape} | {r['impl']} | failed: {r['error']} | | | | |")
            else:
                gpu = f"{r['gpu_ms']:.3f}" if r.get("gpu_ms") else "n/a"
                lines.append(
                    f"| {c.kernel} | {c.shape} | {r['impl']} | {r['ms']:.3f} | {gpu} | {r['rate']:.0f} {unit} "
                    f"| {r['peak_mib']:.0f} | {r['err']:.2e} |"
                )
    lines += [
        "",
        "## Ratios (targets: >= 1.2x eager, >= 1.0x compile; fused CE peak memory <= 0.25x eager)",
        "",
        "Wall = `do_bench` of the Python call (launch overhead included); GPU = the same fwd+bwd replayed as a "
        "CUDA graph. Each ratio is the peer's time over loongforge's (the Triton kernels); tilelang is our "
        "second implementation of sparse MLA.",
        "",
        "| kernel | shape | vs eager (wall) | vs compile (wall) | vs compile (GPU) | vs liger (wall) "
        "| vs liger (GPU) | vs tilelang (wall) | vs tilelang (GPU) | peak mem / eager |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in all_cases:
        by = {r["impl"]: r for r in c.rows if "error" not in r}
        ours = by.get("loongforge")
        if not ours:
            continue

        def ratio(peer, key="ms", ours=ours, by=by):
            if peer not in by or not by[peer].get(key) or not ours.get(key):
                return "n/a"
            return f"{by[peer][key] / ours[key]:.2f}x"

        mem = (
            f"{ours['peak_mib'] / by['eager']['peak_mib']:.3f}"
            if "eager" in by and by["eager"]["peak_mib"]
            else "n/a"
        )
        lines.append(
            f"| {c.kernel} | {c.shape} | {ratio('eager')} | {ratio('compile')} | {ratio('compile', 'gpu_ms')} "
            f"| {ratio('liger')} | {ratio('liger', 'gpu_ms')} | {ratio('tilelang')} | {ratio('tilelang', 'gpu_ms')} "
            f"| {mem} |"
        )
    variant_rows = [(c, r) for c in all_cases for r in c.rows if r["impl"].startswith("lf-") and "error" not in r]
    if variant_rows:
        lines += ["", "## Schedule variants of loongforge's kernel (compile's time over the variant's)", "",
                  "| kernel | shape | variant | vs compile (wall) | vs compile (GPU) | peak mem / eager |",
                  "|---|---|---|---:|---:|---:|"]
        for c, r in variant_rows:
            by = {x["impl"]: x for x in c.rows if "error" not in x}
            comp, eager = by.get("compile", {}), by.get("eager", {})
            wall = f"{comp['ms'] / r['ms']:.3f}x" if comp.get("ms") else "n/a"
            gpu = f"{comp['gpu_ms'] / r['gpu_ms']:.3f}x" if comp.get("gpu_ms") and r.get("gpu_ms") else "n/a"
            mem = f"{r['peak_mib'] / eager['peak_mib']:.3f}" if eager.get("peak_mib") else "n/a"
            lines.append(f"| {c.kernel} | {c.shape} | {r['impl']} | {wall} | {gpu} | {mem} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[Case]:
    global REP_MS, CPU_REPS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes")
    ap.add_argument("--smoke", action="store_true", help="CPU under Triton's interpreter: --quick --no-compile "
                    "--only rope, one timed call")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    ap.add_argument(
        "--only", default="", help="comma-separated kernels: rms_norm,swiglu,rope,flce,moe,sparse_mla"
    )
    ap.add_argument("--out", default="", help="also write the markdown report here")
    ap.add_argument("--results", default=None, help=f"folder of the results table (default {harness.RESULTS})")
    ap.add_argument("--rep", type=int, default=60, help="ms of repetitions per timing (do_bench's rep)")
    ap.add_argument("--flce-variants", action="store_true", help="also time fused CE's other chunk schedules")
    args = ap.parse_args(argv)
    if args.smoke:
        args.quick, args.no_compile, args.only, CPU_REPS = True, True, args.only or "rope", 1
    REP_MS = args.rep
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    only = {k for k in args.only.split(",") if k}
    if "moe" in only:
        only |= {"moe_permute", "moe_unpermute"}
    torch.manual_seed(0)
    all_cases = cases(device, quick=args.quick, compile_=not args.no_compile, only=only,
                      flce_variants=args.flce_variants)
    name = harness.hardware(device)
    for i, c in enumerate(all_cases):
        t0 = time.perf_counter()
        run_case(c, device)
        print(f"[{time.perf_counter() - t0:5.1f}s] {c.kernel} {c.shape}", flush=True)
        if args.out:  # rewritten after every case so a run cut short still leaves its results
            with open(args.out, "w") as f:
                f.write(report(all_cases[: i + 1], name))
    print(report(all_cases, name))
    results = args.results or (None if args.smoke else harness.RESULTS)
    if results:
        rows = [[c.kernel, c.shape, r["impl"], *(["failed: " + r["error"], "", ""] if "error" in r else
                                                  [f"{r['ms']:.3f}", f"{r['gpu_ms']:.3f}" if r.get("gpu_ms") else "",
                                                   f"{r['err']:.2e}"])]
                for c in all_cases for r in c.rows]
        harness.append_rows(Path(results) / "kernels_bench.md", script=__file__, hardware=name, rows=rows,
                            head=["kernel", "shape", "impl", "ms", "GPU ms (graph)", "max err vs fp32 ref"])
    return all_cases


if __name__ == "__main__":
    main()

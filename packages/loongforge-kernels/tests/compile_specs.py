"""Compile every Triton kernel for CUDA ``sm_<arch>`` without a GPU (Triton bundles ptxas): the interpreter runs
kernels as numpy and accepts code the compiler rejects, so the kernel tests compile each one too. Imported by
fresh ``python -c`` processes of the tests (with this folder on ``PYTHONPATH``), where triton is imported without
``TRITON_INTERPRET``."""

from __future__ import annotations

from loongforge_kernels._dispatch import tl

# (pointer dtypes, constexprs, num_warps[, other compile options]) per kernel, at the shapes the benchmarks use
# (bf16 activations).
_COMPILE_SPECS = {
    "rms_norm._rms_norm_fwd_kernel": ({"W": "*fp32", "RSTD": "*fp32"}, {"BLOCK": 2048, "ROWS": 2}, 8),
    "rms_norm._rms_norm_bwd_kernel": (
        {"W": "*fp32", "RSTD": "*fp32", "DW_PART": "*fp32"},
        {"BLOCK": 2048, "ROWS": 2},
        8,
    ),
    "swiglu._swiglu_fwd_kernel": ({}, {"BLOCK": 1024}, 4),
    "swiglu._swiglu_bwd_kernel": ({}, {"BLOCK": 1024}, 4),
    "cross_entropy._ce_stats_kernel": (
        {"LABELS": "*i64", "MAX": "*fp32", "SUMEXP": "*fp32", "TGT": "*fp32"},
        {"BLOCK": 32768},
        32,
    ),
    "cross_entropy._ce_loss_grad_kernel": (
        {"LABELS": "*i64", "LOSS": "*fp32", "SCALE": "*fp32"},
        {"BLOCK": 32768},
        32,
    ),
    "cross_entropy._ce_grad_kernel": (
        {"LABELS": "*i64", "LSE": "*fp32", "SCALE": "*fp32"},
        {"BLOCK": 32768},
        32,
    ),
    "cross_entropy._scale_unless_one_kernel": ({"G": "*fp32"}, {"BLOCK": 8192}, 8),
    "moe_permute._permute_kernel": ({"ROW_ID": "*i32"}, {"TOPK": 8, "BLOCK": 4096}, 8),
    "moe_permute._gather_sum_kernel": (
        {"ROW_ID": "*i32", "PROBS": "*fp32"},
        {"HAS_PROBS": True, "TOPK": 8, "BLOCK": 4096},
        8,
    ),
    "moe_permute._unpermute_bwd_kernel": (
        {"ROW_ID": "*i32", "PROBS": "*fp32", "DPROBS_PART": "*fp32"},
        {"HAS_PROBS": True, "TOPK": 8, "BLOCK": 4096},
        8,
    ),
}
_ROPE = {"FREQS": "*fp32", "CU": "*i32"}
for _mode in (0, 1, 2):
    for _bwd in (False, True):
        _COMPILE_SPECS[f"rope._rope_kernel#{_mode}{_bwd}"] = (
            _ROPE,
            {
                "POS_MODE": _mode,
                "BACKWARD": _bwd,
                "BLOCK_H": 32,
                "BLOCK_HALF": 64,
                "BLOCK_PASS": 32,
                "BLOCK_SEQ": 4,
            },
            8,
        )


# The delta-FP8 codec: the CUDA path (GPU conversions) and the integer-rounding path the interpreter runs,
# with the launch options of fp8_delta.py (no FMA contraction).
_NO_FMA = {"enable_fp_fusion": False}
for _hw in (True, False):
    _COMPILE_SPECS[f"fp8_delta._encode_kernel#{_hw}"] = (
        {"Q": "*u8", "S": "*fp32"},
        {"HW_CVT": _hw, "ROWS": 8, "BLOCK": 256},
        4,
        _NO_FMA,
    )
    _COMPILE_SPECS[f"fp8_delta._decode_kernel#{_hw}"] = (
        {"G": "*u8", "GS": "*fp32"},
        {"HAS_OUT": True, "HW_CVT": _hw, "ROWS": 8, "BLOCK": 256},
        4,
        _NO_FMA,
    )


# The multi-tensor AdamW: tables of int64 addresses, fp32 hyper-parameters, per (param, grad) dtype pair.
_ADAMW = {"WHICH": "*i32", "START": "*i32", "TABLE": "*i64", "S_BASE": "*fp32", "GRAD_SCALE": "*fp32", "ACTIVE": "*u8",
          "OUT": "*fp32",
          **{k: "fp32" for k in ("lr", "beta1", "beta2", "eps", "weight_decay", "log2_beta1", "log2_beta2")}}
_TY = {"bfloat16": "*bf16", "float32": "*fp32"}
for _pd, _gd in (("bfloat16", "bfloat16"), ("float32", "float32"), ("float32", "bfloat16")) if tl else ():
    _COMPILE_SPECS[f"adamw._adamw_kernel#{_pd}{_gd}"] = (
        {**_ADAMW, "P_BASE": _TY[_pd], "G_BASE": _TY[_gd]},
        {"P_DTYPE": getattr(tl, _pd), "G_DTYPE": getattr(tl, _gd), "HAS_SCALE": True, "HAS_SPARSE": True,
         "HW_CVT": True, "P_ALIGN": 8 if _pd == "bfloat16" else 4, "G_ALIGN": 8 if _gd == "bfloat16" else 4,
         "BLOCK": 8192},
        16,
    )
    _COMPILE_SPECS[f"adamw._sumsq_kernel#{_gd}"] = (
        {**_ADAMW, "G_BASE": _TY[_gd]},
        {"HAS_SPARSE": True, "G_ALIGN": 8 if _gd == "bfloat16" else 4, "BLOCK": 8192},
        16,
    )


def compile_kernel(key: str, arch: int = 90):
    """Compile the ``_COMPILE_SPECS[key]`` kernel for CUDA ``sm_<arch>`` without a GPU (Triton bundles ptxas);
    returns Triton's compiled kernel (``.asm["ptx"]`` holds the PTX). Needs triton imported without
    ``TRITON_INTERPRET``."""
    import importlib
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptrs, consts, warps, *options = _COMPILE_SPECS[key]
    module_name, kernel_name = key.partition("#")[0].split(".")
    kernel = getattr(importlib.import_module(f"loongforge_kernels.{module_name}"), kernel_name)
    params = list(inspect.signature(kernel.fn).parameters)
    sig = {}
    for p in params:
        if p in consts:
            sig[p] = "constexpr"
        elif p.isupper():
            sig[p] = ptrs.get(p, "*bf16")
        else:
            sig[p] = ptrs.get(p) or ("fp32" if p in ("eps", "w_offset") else "i32")
    # NOTE: pointers 16-byte aligned, as the launcher specialises them for every tensor the caching allocator hands out
    aligned = {(params.index(p),): [["tt.divisibility", 16]] for p in params if sig[p].startswith("*")}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(params.index(k),): v for k, v in consts.items()},
                    attrs=aligned)
    opts = {"num_warps": warps, **(options[0] if options else {})}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def compile_all_kernels(arch: int = 90) -> list[str]:
    """Compile every Triton kernel for CUDA ``sm_<arch>`` without a GPU.

    The interpreter runs kernels as numpy and accepts code the compiler rejects; this catches that in CI.
    Must run in a process where triton was imported without ``TRITON_INTERPRET``.
    """
    for key in _COMPILE_SPECS:
        compile_kernel(key, arch)
    return list(_COMPILE_SPECS)

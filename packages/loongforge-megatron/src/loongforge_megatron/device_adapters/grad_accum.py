"""Megatron's gradient-accumulation fusion without Apex (``kernels.grad_accum_fusion``).

With ``gradient_accumulation_fusion`` megatron's parallel linears add each weight gradient straight into the
parameter's fp32 ``main_grad`` (the DDP buffer) inside the weight-gradient GEMM, through Apex's CUDA extension
``fused_weight_gradient_mlp_cuda``: no bf16 ``weight.grad`` is written, read back and added by DDP's hook. Without
Apex megatron refuses the flag. This module stands in for the extension's two functions:

- on CUDA, ``torch.addmm(main_grad, grad_outputᵀ, input, out_dtype=fp32, out=main_grad)``: one cuBLAS GEMM with
  bf16/fp16 inputs accumulating into the fp32 buffer (``beta = 1``), Apex's own call;
- elsewhere (CPU tests), ``main_grad.addmm_`` in ``main_grad``'s dtype: the same sum, unfused.

A weight without ``main_grad`` (frozen: DDP gives it no buffer) accumulates nothing if megatron hands one over.
The stand-in is installed only where the real extension does not import, and only for the run.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import torch
from loongforge.accelerator.adaptation import Adaptation

NAME = "grad-accum-fusion"
MODULE = "fused_weight_gradient_mlp_cuda"
_LAYERS = "megatron.core.tensor_parallel.layers"


def wgrad_gemm_accum(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor | None) -> None:
    """``main_grad += grad_outputᵀ @ input`` (2-D: tokens x out, tokens x in), accumulated in ``main_grad``'s dtype."""
    if main_grad is None:
        return
    if main_grad.is_cuda and main_grad.dtype == torch.float32 and input.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(main_grad, grad_output.t(), input, out_dtype=torch.float32, out=main_grad)
        return
    main_grad.addmm_(grad_output.t().to(main_grad.dtype), input.to(main_grad.dtype))


def stand_in() -> types.ModuleType:
    """A module with the extension's two entry points (fp32 and 16-bit ``main_grad``)."""
    module = types.ModuleType(MODULE, "loongforge's stand-in for Apex's fused_weight_gradient_mlp_cuda")
    module.wgrad_gemm_accum_fp32 = wgrad_gemm_accum
    module.wgrad_gemm_accum_fp16 = wgrad_gemm_accum
    return module


def adaptation() -> Adaptation | None:
    """Install the stand-in for megatron's parallel linears (and any later ``import``), or None when Apex's
    extension is there and megatron already uses it."""
    import importlib

    layers = importlib.import_module(_LAYERS)
    if layers._grad_accum_fusion_available:
        return None

    def check() -> bool:
        import inspect

        source = inspect.getsource(layers)
        return f"{MODULE}.wgrad_gemm_accum_fp32(" in source and "_grad_accum_fusion_available" in source

    def apply() -> Callable[[], None]:
        module = stand_in()
        had_module = MODULE in sys.modules
        layers.fused_weight_gradient_mlp_cuda = module
        layers._grad_accum_fusion_available = True
        if not had_module:
            sys.modules[MODULE] = module  # NOTE: megatron.core.utils imports it at call time

        def undo() -> None:
            layers._grad_accum_fusion_available = False
            del layers.fused_weight_gradient_mlp_cuda
            if not had_module:
                sys.modules.pop(MODULE, None)

        return undo

    return Adaptation(NAME, "megatron's gradient-accumulation fusion without Apex: the weight-gradient GEMM "
                            "accumulates into the fp32 main_grad (torch.addmm with out_dtype on CUDA)", apply, check)

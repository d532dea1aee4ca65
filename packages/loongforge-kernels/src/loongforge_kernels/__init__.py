"""loongforge_kernels: fused Triton kernels for LLM training, each with a plain-torch reference.

Each kernel is one file: Triton kernel -> ``torch.autograd.Function`` -> function / ``nn.Module``.
A function's ``impl`` keyword (``auto``, ``torch``, ``triton``) picks the implementation of a direct call;
runs take every op from the core's kernel registry (``providers.py``); see README.md.
"""

from __future__ import annotations

from loongforge_kernels._dispatch import KernelUnavailableError
from loongforge_kernels.cross_entropy import fused_linear_cross_entropy
from loongforge_kernels.fp8_delta import apply_fp8_deltas, encode_fp8_delta
from loongforge_kernels.fp8_quant import fp8_quantize
from loongforge_kernels.moe_permute import moe_permute, moe_unpermute
from loongforge_kernels.moe_router import moe_router_topk
from loongforge_kernels.rms_norm import RMSNorm, rms_norm
from loongforge_kernels.rope import apply_rope
from loongforge_kernels.sparse_mla import dsa_topk_indices, sparse_mla_attention
from loongforge_kernels.swiglu import SwiGLU, swiglu

__all__ = [
    "KernelUnavailableError",
    "RMSNorm",
    "SwiGLU",
    "apply_fp8_deltas",
    "apply_rope",
    "dsa_topk_indices",
    "encode_fp8_delta",
    "fp8_quantize",
    "fused_linear_cross_entropy",
    "moe_permute",
    "moe_router_topk",
    "moe_unpermute",
    "rms_norm",
    "sparse_mla_attention",
    "swiglu",
]

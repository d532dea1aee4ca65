"""Rotary position embedding on the fused ``rope`` kernel: a megatron ``SelfAttention`` whose q/k rotation runs
one kernel instead of megatron's unfused ``_apply_rotary_pos_emb_bshd`` (cat + elementwise kernels).

megatron-core 0.19.2 applies RoPE inline in ``Attention.forward`` (there is no method to override), so
:class:`KernelRoPESelfAttention` takes the rotary embedding out of ``forward``'s arguments and rotates q and k
right where ``get_query_key_value_tensors`` returns them — after the q/k norms, as megatron does. Parameters are
megatron's, so checkpoints and HF name maps are unchanged.

Where the kernel does not apply, megatron's own path runs unchanged (see :meth:`KernelRoPESelfAttention._kernel_rope`):
interleaved rope, a YaRN mscale != 1, inference / flash decode, fused single-QKV rope, positional calls, and
packed THD under context parallelism. MLA (DeepSeek) keeps megatron's ``MLASelfAttention``. On the CPU the
registry serves the plain-torch reference; with no kernel provider installed, megatron's path runs. Multimodal
RoPE (``config.mrope_section``: a VLM's) has a frequency row per token, this rank's tokens under context
parallelism, which megatron's packed path would re-slice: it rotates here always, by megatron's own function where
no kernel is installed.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.attention import SelfAttention

from loongforge_megatron.layers.modules import kernel


class KernelRoPESelfAttention(SelfAttention):
    """megatron ``SelfAttention`` (same submodules and parameters) with RoPE on the registry's ``rope`` op."""

    def __init__(self, *args: Any, provider: str = "auto", accelerator: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.provider, self.accelerator = provider, accelerator
        self._impl = None  # the rope op, or False when no provider serves it (megatron's path then)
        self._pending: tuple | None = None  # (q_freqs, k_freqs, cu_q, cu_kv) for this forward's q/k

    def _kernel_rope(self, args: tuple, kwargs: dict) -> tuple | None:
        """(q_freqs, k_freqs, cu_q, cu_kv) when the kernel can rotate this call's q/k, else None."""
        cfg = self.config
        emb = kwargs.get("rotary_pos_emb")
        if (
            args
            or emb is None
            or kwargs.get("inference_context") is not None
            or kwargs.get("inference_params") is not None
        ):
            return None
        if cfg.rotary_interleaved or cfg.flash_decode or cfg.fused_single_qkv_rope:
            return None
        if cfg.no_rope_freq and cfg.no_rope_freq[self.layer_number - 1]:
            return None  # megatron drops the rope for this layer
        if getattr(self, "_yarn_concentration_factor", 1.0) != 1.0:
            return None
        q_freqs, k_freqs = emb if isinstance(emb, tuple) else (emb, emb)
        cu_q = cu_kv = None
        packed = kwargs.get("packed_seq_params")
        if cfg.mrope_section is not None:
            # NOTE: multimodal RoPE's frequencies are per token (row i is token i's; this context-parallel rank's
            # tokens under CP): packed rows rotate as one sequence, with or without a kernel
            if self._impl is None:
                self._impl = self._lookup(q_freqs)
            return q_freqs, k_freqs, None, None
        if packed is not None and packed.qkv_format == "thd":
            if self.pg_collection.cp.size() > 1:
                return None  # the kernel has no CP slicing of per-sequence positions
            cu_q = (
                packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else packed.cu_seqlens_q
            )
            cu_kv = (
                packed.cu_seqlens_kv_padded
                if packed.cu_seqlens_kv_padded is not None
                else packed.cu_seqlens_kv
            )
        if self._impl is None:
            self._impl = self._lookup(q_freqs)
        return (q_freqs, k_freqs, cu_q, cu_kv) if self._impl else None

    def _lookup(self, freqs: torch.Tensor):
        """The registry's rope op for ``freqs``' device, or False when no kernel package is installed."""
        try:
            return kernel("rope", provider=self.provider, device_type=freqs.device.type, accelerator=self.accelerator)
        except KeyError:
            return False

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any
    ):
        """megatron's forward; when the kernel applies, the rotary embedding is applied in
        :meth:`get_query_key_value_tensors` instead of by megatron."""
        rope = self._kernel_rope(args, kwargs)
        if rope is None:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        self._pending = rope
        try:
            return super().forward(hidden_states, attention_mask, **{**kwargs, "rotary_pos_emb": None})
        finally:
            self._pending = None

    def get_query_key_value_tensors(self, *args: Any, **kwargs: Any):
        """megatron's q, k, v (and gate), with q and k rotated when :meth:`forward` took the embedding."""
        out = super().get_query_key_value_tensors(*args, **kwargs)
        if self._pending is None:
            return out
        q_freqs, k_freqs, cu_q, cu_kv = self._pending
        query, key, *rest = out
        return (self._rotate(query, q_freqs, cu_q), self._rotate(key, k_freqs, cu_kv), *rest)

    def _rotate(
        self, x: torch.Tensor, freqs: torch.Tensor | None, cu_seqlens: torch.Tensor | None
    ) -> torch.Tensor:
        if freqs is None:
            return x
        if not self._impl:  # multimodal RoPE without a kernel package: megatron's own rotation, token by token
            from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

            return _apply_rotary_pos_emb_bshd(x, freqs)
        if cu_seqlens is None:  # sbhd; under CP, megatron's RotaryEmbedding already sliced freqs to this rank
            return self._impl(x, freqs)
        return self._impl(x.squeeze(1), freqs, cu_seqlens=cu_seqlens).unsqueeze(1)  # THD: [t, 1, h, d]

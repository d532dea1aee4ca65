"""LeRobot pi05's joint (prefix layer, expert layer) step with ``scaled_dot_product_attention``, installed as a
named, checked, reversible adaptation of ``modeling_pi05.compute_layer_complete``, applied for a run (``adaptations``).

LeRobot's ``compute_layer_complete`` concatenates both streams' queries/keys/values and calls transformers'
``eager_attention_forward``: the (B, 8, L, L) scores are materialised (and kept for backward) with the 4-D
additive mask. The training mask of ``PI05Pytorch.forward`` is a prefix-LM mask: prefix tokens (images,
language) see the valid prefix tokens, action tokens see every valid token. So the twin makes two SDPA calls
with no 2-D mask, only a (B, 1, 1, L) key-padding vector (the language padding): prefix queries over the
prefix keys, action queries over all keys. With one key-value head (both Gemma variants) the 8 query heads fold
into the query length — MQA as single-head attention over L·8 query rows — so nothing is repeated or transposed.
A compiled unit runs the same twin with the attention as two GEMMs around a fused masked softmax
(``matmul_layer_complete``): with pi05's short key sequences that beats the flash kernels (``_attend_matmul``).

Outputs equal LeRobot's for every valid token (padded prefix rows differ: they are never read). The
dispatcher changes nothing for models that did not opt in (LeRobot's own ``PI05Policy`` keeps eager attention):
our model marks its prefix layers (``mark_layers``). It also enters FSDP2 units explicitly — the joint step
calls the layers' submodules, never ``layer.forward``, so FSDP's forward hooks would not fire — and runs a
compiled body when the job compiled the unit.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from lerobot.policies.pi_gemma import _gated_residual, layernorm_forward
from loongforge.accelerator.adaptation import Adaptation, AdaptationSet, replace_attr
from transformers.models.gemma.modeling_gemma import rotate_half

from loongforge_embodied.policies.lerobot_pi05.build import MODELING, source_has

NAME = "pi05-joint-layer"
MODE = "_loongforge_attention"  # on a prefix layer: "sdpa" or "eager" (LeRobot's own step)
LAST = "_loongforge_last"  # on the last prefix layer: its prefix output is never read


def sdpa_layer_complete(inputs_embeds, attention_mask, position_ids, adarms_cond, layers, rotary_emb):
    """Twin of LeRobot's ``compute_layer_complete`` (same arguments and results) with SDPA attention."""
    return _layer_complete(inputs_embeds, attention_mask, position_ids, adarms_cond, layers, rotary_emb, _attend)


def matmul_layer_complete(inputs_embeds, attention_mask, position_ids, adarms_cond, layers, rotary_emb):
    """The twin with the attention as two batched GEMMs around a masked fp32 softmax (``_attend_matmul``): what a
    compiled unit runs."""
    return _layer_complete(inputs_embeds, attention_mask, position_ids, adarms_cond, layers, rotary_emb,
                           _attend_matmul)


def _layer_complete(inputs_embeds, attention_mask, position_ids, adarms_cond, layers, rotary_emb, attend):
    # NOTE: in the last layer only the prefix keys/values are read (by the action tokens): no prefix queries.
    skip_prefix = getattr(layers[0], LAST, False)
    qs, ks, vs, gates = [], [], [], []
    for i, (layer, hidden, cond) in enumerate(zip(layers, inputs_embeds, adarms_cond, strict=True)):
        h, gate = layernorm_forward(layer.input_layernorm, hidden, cond)
        gates.append(gate)
        attn = layer.self_attn
        shape = (*h.shape[:2], -1, attn.head_dim)  # (B, L, heads, D): heads next to the sequence
        qs.append(None if i == 0 and skip_prefix else attn.q_proj(h).view(shape))
        ks.append(attn.k_proj(h).view(shape))
        vs.append(attn.v_proj(h).view(shape))
    # NOTE: LeRobot concatenates the streams (dtype promotion), then applies RoPE to the whole sequence.
    dtype = torch.promote_types(ks[0].dtype, ks[1].dtype)
    cos, sin = rotary_emb(ks[1].new_empty(0, dtype=dtype), position_ids)
    n_prefix = inputs_embeds[0].shape[1]
    for i, part in enumerate((slice(0, n_prefix), slice(n_prefix, None))):
        c, s = cos[:, part].unsqueeze(2), sin[:, part].unsqueeze(2)
        ks[i] = _rope(ks[i].to(dtype), c, s)
        qs[i] = None if qs[i] is None else _rope(qs[i].to(dtype), c, s)
    keys, values = torch.cat(ks, dim=1), torch.cat([v.to(dtype) for v in vs], dim=1)
    valid = _valid_keys(attention_mask)
    scale = layers[0].self_attn.scaling
    outs = [None if qs[0] is None else attend(qs[0], keys[:, :n_prefix], values[:, :n_prefix], valid[:, :n_prefix],
                                              scale),
            attend(qs[1], keys, values, valid, scale)]

    results = []
    for i, (layer, hidden, cond) in enumerate(zip(layers, inputs_embeds, adarms_cond, strict=True)):
        if outs[i] is None:
            results.append(hidden)  # the last prefix layer's output: PI05Pytorch.forward keeps only actions
            continue
        out = outs[i]
        if out.dtype != layer.self_attn.o_proj.weight.dtype:
            out = out.to(layer.self_attn.o_proj.weight.dtype)
        # NOTE: LeRobot clones the first residual; nothing writes to it in place, so the copy is dropped.
        residual = _gated_residual(hidden, layer.self_attn.o_proj(out), gates[i])
        out, gate = layernorm_forward(layer.post_attention_layernorm, residual, cond)
        if layer.mlp.up_proj.weight.dtype == torch.bfloat16:
            out = out.to(dtype=torch.bfloat16)
        results.append(_gated_residual(residual, layer.mlp(out), gate))
    return results


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' Gemma ``apply_rotary_pos_emb`` for one tensor (cos/sin already broadcast over heads)."""
    return x * cos + rotate_half(x) * sin


def _valid_keys(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) keys an action token may attend to: the last query row of LeRobot's 4-D mask (additive: 0 = keep)."""
    row = attention_mask[:, 0, -1, :]
    return row if row.dtype == torch.bool else row == 0


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q (B, Lq, H, D) over k/v (B, Lk, 1, D) with a key-padding mask; returns (B, Lq, H·D).

    NOTE: with one key-value head (LeRobot's joint layer assumes it: ``1 * 8 * head_dim``) the H query heads are
    just more query rows of a single-head attention: no K/V repeat, no transpose of q or of the output."""
    b, lq, h, d = q.shape
    out = F.scaled_dot_product_attention(q.reshape(b, 1, lq * h, d), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=valid[:, None, None, :], scale=scale)
    return out.view(b, lq, h * d)


# Key sequences up to this long take _attend_matmul in a compiled unit (measured: pi05's ~290-340 keys); longer ones
# SDPA, whose flash kernels keep no (queries x keys) probabilities for backward.
MATMUL_MAX_KEYS = 512


def _attend_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """``_attend`` as LeRobot's eager attention computes it: scores from a GEMM, the key-padding mask (its finite
    minimum, as LeRobot's mask: a row with no valid key averages instead of giving NaN), softmax in fp32,
    probabilities in the query's dtype, a second GEMM. With short key sequences (pi05: ~290 prefix keys) the scores
    are small (B x 8·L x L); inside a compiled unit the scale, mask and softmax fuse into one kernel each way, and
    forward + backward take 0.56 ms per joint layer on the H200 against 0.69 ms for SDPA's cuDNN flash kernels,
    which are built for long key sequences (``benchmarks/tools/pi05_levers.py --only attention``). Longer key sequences
    (``MATMUL_MAX_KEYS``) go to SDPA."""
    if k.shape[1] > MATMUL_MAX_KEYS:
        return _attend(q, k, v, valid, scale)
    b, lq, h, d = q.shape
    q2, k2, v2 = q.reshape(b, lq * h, d), k.reshape(b, -1, d), v.reshape(b, -1, d)
    scores = torch.matmul(q2, k2.transpose(1, 2)) * scale
    scores = scores.masked_fill(~valid[:, None, :], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v2).view(b, lq, h * d)


def _call(fn: Callable, *args: Any) -> Any:
    return fn(*args)


def _entered(module: torch.nn.Module, fn: Callable) -> Callable:
    """``fn`` run inside ``module``'s FSDP2 pre/post-forward (all-gather, reshard, backward hooks) when it is a
    ``fully_shard`` unit; else ``fn`` itself."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if not isinstance(module, FSDPModule):
        return fn
    if "_loongforge_call" not in module.__dict__:
        module._loongforge_call = _call
        register_fsdp_forward_method(module, "_loongforge_call")
    return functools.partial(module._loongforge_call, fn)


@functools.cache
def _compiled(body: Callable, mode: str | None) -> Callable:
    return torch.compile(body, mode=mode)


def _dispatcher(original: Callable) -> Callable:
    def compute_layer_complete(inputs_embeds, attention_mask, position_ids, adarms_cond, layers, rotary_emb):
        mode = getattr(layers[0], MODE, None)
        if mode is None:  # not our model: LeRobot's step, untouched
            return original(inputs_embeds, attention_mask, position_ids, adarms_cond, layers=layers,
                            rotary_emb=rotary_emb)
        body = sdpa_layer_complete if mode == "sdpa" else original
        if layers[0]._compiled_call_impl is not None:  # the job compiled this unit (``unit.compile()``)
            # NOTE: compiled, the twin takes the GEMM + fused-softmax attention (faster there, see _attend_matmul);
            # eager, SDPA (one kernel instead of the unfused scale / mask / softmax passes)
            body = _compiled(matmul_layer_complete if mode == "sdpa" else body,
                             getattr(layers[0], "_loongforge_compile_mode", None))
        run = functools.partial(body, layers=layers, rotary_emb=rotary_emb)
        for layer in reversed(layers):  # the expert unit innermost
            run = _entered(layer, run)
        return run(inputs_embeds, attention_mask, position_ids, adarms_cond)

    compute_layer_complete.__wrapped__ = original
    return compute_layer_complete


def joint_layer_adaptation():
    """The adaptation: ``compute_layer_complete`` → the dispatcher (checked against LeRobot's source first)."""
    return replace_attr(
        NAME, f"{MODELING}.compute_layer_complete", _dispatcher,
        description="pi05's joint prefix/expert layer: SDPA twin + explicit FSDP2 units for marked models",
        expect=source_has("eager_attention_forward(", "layernorm_forward(layer.input_layernorm",
                          "1 * 8 * head_dim", "_gated_residual(", "rotary_emb(dummy_tensor, position_ids)",
                          "apply_rotary_pos_emb("),
    )


MASK_NAME = "pi-gemma-mask-kwargs"
PI_GEMMA = "lerobot.policies.pi_gemma"


def _mask_with_new_kwargs(original: Callable, *args: Any, cache_position: Any = None, past_key_values: Any = None,
                          **kwargs: Any):
    """LeRobot's ``create_causal_mask(cache_position=…, past_key_values=…)`` call in the signature of
    transformers >= 5.6 (``cache=…``; the cache position is derived from the cache)."""
    return original(*args, cache=past_key_values, **kwargs)


def mask_kwargs_adaptation():
    """LeRobot 0.6.1 (which pins transformers < 5.6) builds ``PiGemmaModel``'s mask with the old keywords; newer
    transformers reject ``cache_position``, so every KV-cached prefix pass (``sample_actions``: inference)
    fails. ``None`` where the installed transformers still takes them. Training never reaches this call with
    a cache, but it is the same call, so the shim is transparent there."""
    from transformers import masking_utils

    params = inspect.signature(masking_utils.create_causal_mask).parameters
    if "cache_position" in params or "cache" not in params:
        return None
    return replace_attr(
        MASK_NAME, f"{PI_GEMMA}.create_causal_mask", lambda original: functools.partial(_mask_with_new_kwargs, original),
        description="LeRobot's PiGemmaModel mask call (cache_position=, past_key_values=) in transformers >= 5.6's "
                    "keywords (cache=)",
        expect=lambda original: original is masking_utils.create_causal_mask and _pi_gemma_calls_old_kwargs(),
    )


def _pi_gemma_calls_old_kwargs() -> bool:
    from lerobot.policies.pi_gemma import PiGemmaModel

    return source_has("create_causal_mask(", "cache_position=cache_position,",
                      "past_key_values=past_key_values,")(PiGemmaModel.forward)


SYNC_NAME = "pi05-async-masks"


class _TorchWithAsyncTensor:
    """``torch`` as LeRobot's pi05 module sees it, except ``torch.tensor(data, device=<cuda>)``: built in pinned
    host memory and copied without blocking. The plain call copies from pageable memory, which waits for the
    stream to drain (``cudaStreamSynchronize``): ``embed_prefix`` / ``embed_suffix`` build their attention masks
    from Python lists this way, twice a step, so the GPU ran dry while the host caught up (measured: the only
    two stream syncs of a pi05 training step on the H200). Same values, same dtype and device."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def tensor(self, data, *args, device=None, **kwargs):
        real = self._real
        if device is None or real.device(device).type != "cuda" or isinstance(data, real.Tensor) or args \
                or kwargs.keys() - {"dtype"}:
            return real.tensor(data, *args, device=device, **kwargs)
        return real.tensor(data, **kwargs).pin_memory().to(device, non_blocking=True)


def async_masks_adaptation():
    """``modeling_pi05``'s ``torch`` → :class:`_TorchWithAsyncTensor` (checked: the two mask builders still
    call ``torch.tensor(att_masks, …)``)."""

    def expect(original) -> bool:
        from lerobot.policies.pi05.modeling_pi05 import PI05Pytorch

        return original is torch and all(source_has("att_masks = torch.tensor(att_masks,")(f)
                                         for f in (PI05Pytorch.embed_prefix, PI05Pytorch.embed_suffix))

    return replace_attr(
        SYNC_NAME, f"{MODELING}.torch", _TorchWithAsyncTensor,
        description="pi05's mask tensors from Python lists copied to the GPU from pinned memory, without the "
                    "stream sync of a pageable copy",
        expect=expect,
    )


QKV_NAME = "pi05-siglip-fused-qkv"


def _fused_qkv_forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
    """``SiglipAttention.forward`` with q, k and v as one GEMM over the concatenated weights: the same math.
    Inside a compiled unit the concatenation fuses into autocast's cast of the fp32 weights, so it costs no pass
    of its own; one (tokens x 1152) @ (1152 x 3456) GEMM runs ~3.6% faster per layer than three 1152-wide ones
    on the H200 (``benchmarks/tools/pi05_levers.py``)."""
    from transformers.models.siglip.modeling_siglip import (
        ALL_ATTENTION_FUNCTIONS,
        SiglipAttention,
        eager_attention_forward,
    )

    projections = (self.q_proj, self.k_proj, self.v_proj)
    if any(type(m) is not torch.nn.Linear or m.bias is None or m._forward_hooks or m._forward_pre_hooks
           for m in projections):
        # NOTE: a wrapped or hooked projection (LoRA, fp8 linears, ...) must run as itself
        return SiglipAttention.forward(self, hidden_states, attention_mask, **kwargs)
    input_shape = hidden_states.shape[:-1]
    weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
    bias = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
    qkv = F.linear(hidden_states, weight, bias).view(*input_shape, 3, -1, self.head_dim)
    queries, keys, values = (t.transpose(1, 2) for t in qkv.unbind(-3))
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                eager_attention_forward)
    attn_output, attn_weights = attention_interface(
        self, queries, keys, values, attention_mask, is_causal=self.is_causal, scaling=self.scale,
        dropout=0.0 if not self.training else self.dropout,
    )
    return self.out_proj(attn_output.reshape(*input_shape, -1).contiguous()), attn_weights


def fuse_siglip_qkv(layers) -> None:
    """Give these SigLIP encoder layers' attention ``_fused_qkv_forward`` (per instance: LeRobot's own policy
    and other models keep transformers' forward), after checking that transformers' forward is still the one
    it restates."""
    from loongforge.errors import AdaptationError
    from transformers.models.siglip.modeling_siglip import SiglipAttention

    expected = source_has("self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
                          "self.k_proj(hidden_states)", "self.v_proj(hidden_states)", "attention_interface(",
                          "scaling=self.scale", "self.out_proj(attn_output)")
    if not expected(SiglipAttention.forward):
        raise AdaptationError(f"adaptation '{QKV_NAME}': SiglipAttention.forward no longer matches what it "
                              "restates; the library was probably upgraded — review the adaptation")
    for layer in layers:
        attn = layer.self_attn
        if type(attn) is SiglipAttention:
            attn.forward = _fused_qkv_forward.__get__(attn)


SIGLIP_NAME = "pi05-siglip-names"


def siglip_names_adaptation():
    """LeRobot's ``PI05Policy._fix_pytorch_state_dict_keys`` followed by SigLIP's names in the installed
    transformers' layout. ``None`` where transformers still nests the tower under ``vision_model`` (< 5.6, what
    LeRobot 0.6.1 supports and what checkpoints, ours included, are written in)."""
    from loongforge_embodied.policies import siglip_names

    if siglip_names.installed_nests():
        return None

    def factory(original: Callable) -> Callable:
        @functools.wraps(original)
        def fix_keys(self, state_dict, model_config):
            return siglip_names.match(original(self, state_dict, model_config), self.state_dict().keys())

        return fix_keys

    return replace_attr(
        SIGLIP_NAME, f"{MODELING}.PI05Policy._fix_pytorch_state_dict_keys", factory,
        description="LeRobot's pi05 key fixes, then SigLIP names in the installed transformers' layout",
        expect=source_has("fixed_state_dict[new_key] = value", "return fixed_state_dict"),
    )


def adaptations() -> list[Adaptation]:
    """The adaptations a run of this policy applies: the joint-layer dispatcher (models that did not opt in are
    unaffected), the sync-free mask tensors (LeRobot's own ``PI05Policy`` in the same run gets them too, with the
    same values), and the mask-keyword and SigLIP-name shims where the installed transformers needs them."""
    found = (joint_layer_adaptation(), async_masks_adaptation(), mask_kwargs_adaptation(), siglip_names_adaptation())
    return [a for a in found if a is not None]


def adapted() -> AdaptationSet:
    """``with adapted(): ...``: :func:`adaptations` for the block (a job applies them for its run). Also what
    ``PI05Policy.from_pretrained`` of our export needs under transformers >= 5.6 (the SigLIP names)."""
    return AdaptationSet(adaptations())


def is_adapted() -> bool:
    """Whether the joint-layer dispatcher is applied now."""
    from loongforge.accelerator.adaptation import active

    return NAME in active()


def mark_layers(prefix_layers, *, sdpa: bool) -> None:
    """Opt a model's prefix layers into the dispatcher (``sdpa`` or LeRobot's eager step); it runs while
    :func:`adaptations` are applied (a job's run, or ``with adapted():``)."""
    for layer in prefix_layers:
        setattr(layer, MODE, "sdpa" if sdpa else "eager")
    setattr(prefix_layers[-1], LAST, True)

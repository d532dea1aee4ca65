"""HF name maps of the hybrid LMs: per layer the gated DeltaNet (``linear_attn``) or the gated full attention
(``self_attn``), zero-centred norms, and a dense MLP or a MoE block with a gated shared expert.

Two HF layouts of the DeltaNet projections: fused per key head (``in_proj_qkvz`` / ``in_proj_ba``, Qwen3-Next) or
split (``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, Qwen3.5); both load into the same megatron
parameters (``layers.GatedDeltaNet``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from loongforge.checkpoint import ColumnParallel, Entry, GatedMLP, NameMap, Replicated, RowParallel
from loongforge.errors import CheckpointError

from loongforge_megatron.models.gpt.names import (
    H,
    L,
    dense_mlp,
    ends,
    fused_experts,
    hd,
    head_dim,
    kv_heads,
    norms,
    num_query_groups,
    routed_experts,
)
from loongforge_megatron.models.hybrid.rules import GatedQKV, Regrouped

HFConfig = dict[str, Any]


def layer_types(h: HFConfig) -> list[str]:
    """The HF config's ``layer_types`` (or its default: every ``full_attention_interval``-th layer full)."""
    types = h.get("layer_types")
    if types:
        return list(types)
    n = h.get("full_attention_interval", 4)
    return ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(h["num_hidden_layers"])]


def _dims(c: Any) -> tuple:
    """(key heads, value heads, key dim, value dim) of the DeltaNet from a config (plain or size-tracking)."""
    return c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]


def gated_attention(h: HFConfig, *, layers: Callable[[int], bool]) -> list[Entry]:
    """Full attention with an output gate in ``q_proj`` and zero-centred per-head q / k norms."""
    rule = GatedQKV(num_heads=h["num_attention_heads"], num_query_groups=num_query_groups(h), head_dim=head_dim(h))
    a = H + "self_attn."

    def qkv(c: Any) -> dict:
        return {"q": (2 * c["num_attention_heads"] * hd(c), c["hidden_size"]),
                "k": (kv_heads(c) * hd(c), c["hidden_size"]), "v": (kv_heads(c) * hd(c), c["hidden_size"])}

    return [
        Entry(L + "self_attention.linear_qkv.weight", {r: f"{a}{r}_proj.weight" for r in ("q", "k", "v")}, rule,
              layers=layers, shape=qkv),
        Entry(L + "self_attention.linear_proj.weight", a + "o_proj.weight", RowParallel(), layers=layers,
              shape=lambda c: (c["hidden_size"], c["num_attention_heads"] * hd(c))),
        Entry(L + "self_attention.q_layernorm.weight", a + "q_norm.weight", Replicated(), layers=layers,
              shape=lambda c: (hd(c),)),
        Entry(L + "self_attention.k_layernorm.weight", a + "k_norm.weight", Replicated(), layers=layers,
              shape=lambda c: (hd(c),)),
    ]


def gated_delta_net(h: HFConfig, *, layers: Callable[[int], bool], split: bool) -> list[Entry]:
    """The gated DeltaNet; ``split``: Qwen3.5's four input projections, else Qwen3-Next's two fused ones."""
    hk, hv, dk, dv = _dims(h)
    m, a = L + "self_attention.", H + "linear_attn."
    conv = Regrouped(groups=hk, sections=(("t", (hk * dk, hk * dk, hv * dv)),))

    def rows(c: Any, n: Any) -> tuple:
        return (n, c["hidden_size"])

    out = []
    if split:
        out += [
            Entry(m + "in_proj_qkvz.weight", {"qkv": a + "in_proj_qkv.weight", "z": a + "in_proj_z.weight"},
                  Regrouped(groups=hk, sections=(("qkv", (hk * dk, hk * dk, hv * dv)), ("z", (hv * dv,)))),
                  layers=layers, shape=lambda c: {"qkv": rows(c, 2 * _dims(c)[0] * _dims(c)[2] + _dims(c)[1] * _dims(c)[3]),
                                                  "z": rows(c, _dims(c)[1] * _dims(c)[3])}),
            Entry(m + "in_proj_ba.weight", {"b": a + "in_proj_b.weight", "a": a + "in_proj_a.weight"},
                  Regrouped(groups=hk, sections=(("b", (hv,)), ("a", (hv,)))), layers=layers,
                  shape=lambda c: {"b": rows(c, _dims(c)[1]), "a": rows(c, _dims(c)[1])}),
        ]
    else:
        out += [
            Entry(m + "in_proj_qkvz.weight", a + "in_proj_qkvz.weight", ColumnParallel(), layers=layers,
                  shape=lambda c: rows(c, 2 * _dims(c)[0] * _dims(c)[2] + 2 * _dims(c)[1] * _dims(c)[3])),
            Entry(m + "in_proj_ba.weight", a + "in_proj_ba.weight", ColumnParallel(), layers=layers,
                  shape=lambda c: rows(c, 2 * _dims(c)[1])),
        ]
    out += [
        Entry(m + "conv1d.weight", a + "conv1d.weight", conv, layers=layers,
              shape=lambda c: (2 * _dims(c)[0] * _dims(c)[2] + _dims(c)[1] * _dims(c)[3], 1, c["linear_conv_kernel_dim"])),
        Entry(m + "A_log", a + "A_log", ColumnParallel(), layers=layers, shape=lambda c: (_dims(c)[1],)),
        Entry(m + "dt_bias", a + "dt_bias", ColumnParallel(), layers=layers, shape=lambda c: (_dims(c)[1],)),
        Entry(m + "norm.weight", a + "norm.weight", Replicated(), layers=layers, shape=lambda c: (_dims(c)[3],)),
        Entry(m + "out_proj.weight", a + "out_proj.weight", RowParallel(), layers=layers,
              shape=lambda c: (c["hidden_size"], _dims(c)[1] * _dims(c)[3])),
    ]
    return out


def shared_expert(*, layers: Callable[[int], bool] | None = None) -> list[Entry]:
    """A MoE block's shared expert and its sigmoid gate (megatron's ``moe_shared_expert_gate``)."""
    s, hs = "mlp.shared_experts.", "mlp.shared_expert."
    ffn = "shared_expert_intermediate_size"
    return [
        Entry(L + s + "linear_fc1.weight", {"gate": H + hs + "gate_proj.weight", "up": H + hs + "up_proj.weight"},
              GatedMLP(), layers=layers, shape=lambda c: (c[ffn], c["hidden_size"])),
        Entry(L + s + "linear_fc2.weight", H + hs + "down_proj.weight", RowParallel(), layers=layers,
              shape=lambda c: (c["hidden_size"], c[ffn])),
        Entry(L + s + "gate_weight", H + "mlp.shared_expert_gate.weight", Replicated(), layers=layers,
              shape=lambda c: (1, c["hidden_size"])),
    ]


MTP = "mtp."


def mtp_layers_in(names: list[str]) -> int:
    """The multi-token-prediction layers a checkpoint holds: ``mtp.layers.<k>`` (one ``mtp.fc`` for them all)."""
    depths = {int(n.split(".")[2]) for n in names if n.startswith(MTP + "layers.") and n.split(".")[2].isdigit()}
    if not depths:
        return 0
    if depths != {0} or MTP + "fc.weight" not in names:
        raise CheckpointError(f"multi-token-prediction tensors of layers {sorted(depths)}"
                              f"{'' if MTP + 'fc.weight' in names else ' without mtp.fc.weight'}: the HF layout "
                              "holds one MTP layer (mtp.layers.0, mtp.fc, mtp.pre_fc_norm_*, mtp.norm)")
    return 1


def mtp(h: HFConfig, *, first: list[Entry], layer: list[Entry]) -> list[Entry]:
    """The published checkpoints' multi-token-prediction layer (``mtp_num_hidden_layers`` 1) <-> megatron's
    ``mtp.layers.0``: ``pre_fc_norm_embedding`` / ``pre_fc_norm_hidden`` (enorm / hnorm), ``fc`` (eh_proj, the
    embedding's half first), a full-attention decoder layer (``layer``'s entries) and ``norm``; the embedding and
    the head are the model's own (the last stage's copy of the embedding when the pipeline splits them)."""
    if not h.get("num_nextn_predict_layers"):
        return []
    m = "mtp.layers.*."

    def vec(c: Any) -> tuple:
        return (c["hidden_size"],)

    out = [replace(first[0], stage="mtp_copy", export=False),
           Entry(m + "enorm.weight", MTP + "pre_fc_norm_embedding.weight", Replicated(), stage="mtp", shape=vec,
                 hf_depth=True),
           Entry(m + "hnorm.weight", MTP + "pre_fc_norm_hidden.weight", Replicated(), stage="mtp", shape=vec,
                 hf_depth=True),
           Entry(m + "eh_proj.weight", MTP + "fc.weight", ColumnParallel(), stage="mtp", hf_depth=True,
                 shape=lambda c: (c["hidden_size"], 2 * c["hidden_size"])),
           Entry(m + "final_layernorm.weight", MTP + "norm.weight", Replicated(), stage="mtp", shape=vec,
                 hf_depth=True)]
    for e in layer:
        hf = {r: p.replace(H, m, 1) for r, p in e.hf_patterns().items()}
        out.append(replace(e, megatron=e.megatron.replace(L, m + "mtp_model_layer.", 1), stage="mtp", layers=None,
                           hf=hf[next(iter(hf))] if isinstance(e.hf, str) else hf, hf_depth=True))
    return out


def name_map(h: HFConfig, *, divisible_by: int, split: bool, fused: bool = False) -> NameMap:
    """The whole decoder (and the multi-token-prediction layer the checkpoint holds: ``num_nextn_predict_layers``).
    MoE when ``num_experts`` > 0 (every layer); ``fused``: the routed experts as transformers' 3-D
    ``gate_up_proj`` / ``down_proj``, else one tensor per expert."""
    types = layer_types(h)
    first, last = ends(h, divisible_by=divisible_by)

    def linear(i: int) -> bool:
        return types[i] == "linear_attention"

    def full(i: int) -> bool:
        return types[i] != "linear_attention"

    mlp: list[Entry]
    experts = h.get("num_experts") or 0
    if experts:
        mlp = (fused_experts(experts, hidden=h["hidden_size"], ffn=h["moe_intermediate_size"]) if fused
               else routed_experts(experts)) + shared_expert()
    else:
        mlp = dense_mlp()
    body = norms() + gated_attention(h, layers=full) + gated_delta_net(h, layers=linear, split=split) + mlp
    extra = mtp(h, first=first, layer=norms() + gated_attention(h, layers=full) + mlp)
    return NameMap(first + body + extra + last)

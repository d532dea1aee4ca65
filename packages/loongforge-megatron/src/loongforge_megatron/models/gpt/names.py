"""HF name-map building blocks of the GPT families: megatron-core local-spec names <-> HF names for the usual
pieces (embedding / head, norms, GQA or MLA attention, dense MLP, routed experts).

Names are those of megatron-core 0.19.2's local (non-TransformerEngine) GPT layer spec; the test
``test_megatron_names.py`` builds real models and fails if an upgrade renames anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loongforge.checkpoint import (
    ColumnParallel,
    Entry,
    Expert,
    FusedExperts,
    FusedQKV,
    GatedMLP,
    NameMap,
    Replicated,
    RowParallel,
    VocabParallel,
)
from loongforge.errors import CheckpointError

from loongforge_megatron.conversion.sizes import Size, Sizes

HFConfig = dict[str, Any]
L = "decoder.layers.*."
H = "model.layers.*."


def head_dim(h: HFConfig) -> int:
    return h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"]


def num_query_groups(h: HFConfig) -> int:
    return h.get("num_key_value_heads") or h["num_attention_heads"]


# ---- HF shapes as functions of the config (``Entry.shape``; ``c`` reads sizes that remember their keys)
def hd(c: Sizes) -> Size:
    """Attention head dim: ``head_dim``, else hidden_size / num_attention_heads."""
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def kv_heads(c: Sizes) -> Size:
    return c.get("num_key_value_heads") or c["num_attention_heads"]


def experts(c: Sizes) -> Size:
    """Routed experts (DeepSeek's ``n_routed_experts``, Qwen's ``num_experts``, transformers 5's
    ``num_local_experts``)."""
    return c.get("n_routed_experts") or c.get("num_experts") or c["num_local_experts"]


def _vector(c: Sizes) -> tuple:
    return (c["hidden_size"],)


def _vocab_rows(c: Sizes) -> tuple:
    return (c["vocab_size"], c["hidden_size"])


def ends(h: HFConfig, *, divisible_by: int) -> tuple[list[Entry], list[Entry]]:
    """Embedding (first stage) and final norm + output layer (last stage); tied heads reuse the embedding."""
    vocab = VocabParallel(vocab_size=h["vocab_size"], divisible_by=divisible_by)
    first = [Entry("embedding.word_embeddings.weight", "model.embed_tokens.weight", vocab, stage="first",
                   shape=_vocab_rows)]
    last = [Entry("decoder.final_layernorm.weight", "model.norm.weight", Replicated(), stage="last", shape=_vector)]
    if h.get("tie_word_embeddings", False):
        # NOTE: with pp > 1 megatron keeps a copy of the embedding as output_layer.weight on the last stage.
        last.append(Entry("output_layer.weight", "model.embed_tokens.weight", vocab, stage="last_tied", export=False,
                          shape=_vocab_rows))
    else:
        last.append(Entry("output_layer.weight", "lm_head.weight", vocab, stage="last", shape=_vocab_rows))
    return first, last


def norms() -> list[Entry]:
    return [
        Entry(L + "input_layernorm.weight", H + "input_layernorm.weight", Replicated(), shape=_vector),
        Entry(L + "pre_mlp_layernorm.weight", H + "post_attention_layernorm.weight", Replicated(), shape=_vector),
    ]


def gqa_attention(h: HFConfig, *, qkv_bias: bool = False, qk_norm: bool = False) -> list[Entry]:
    """Self attention with fused QKV (GQA interleave), optional q/k/v biases and per-head q/k RMSNorm."""
    qkv = FusedQKV(num_heads=h["num_attention_heads"], num_query_groups=num_query_groups(h), head_dim=head_dim(h))
    proj = H + "self_attn."

    def qkv_shape(c: Sizes) -> dict:
        q, kv = c["num_attention_heads"] * hd(c), kv_heads(c) * hd(c)
        return {"q": (q, c["hidden_size"]), "k": (kv, c["hidden_size"]), "v": (kv, c["hidden_size"])}

    def bias_shape(c: Sizes) -> dict:
        return {r: s[:1] for r, s in qkv_shape(c).items()}

    out = [
        Entry(L + "self_attention.linear_qkv.weight",
              {r: f"{proj}{r}_proj.weight" for r in ("q", "k", "v")}, qkv, shape=qkv_shape),
        Entry(L + "self_attention.linear_proj.weight", proj + "o_proj.weight", RowParallel(),
              shape=lambda c: (c["hidden_size"], c["num_attention_heads"] * hd(c))),
    ]
    if qkv_bias:
        out.append(Entry(L + "self_attention.linear_qkv.bias", {r: f"{proj}{r}_proj.bias" for r in ("q", "k", "v")}, qkv,
                         shape=bias_shape))
    if qk_norm:
        out.append(Entry(L + "self_attention.q_layernorm.weight", proj + "q_norm.weight", Replicated(),
                         shape=lambda c: (hd(c),)))
        out.append(Entry(L + "self_attention.k_layernorm.weight", proj + "k_norm.weight", Replicated(),
                         shape=lambda c: (hd(c),)))
    return out


def dense_mlp(*, layers: Callable[[int], bool] | None = None, m: str = "mlp.", hf: str = "mlp.") -> list[Entry]:
    """SwiGLU MLP: gate/up fused into linear_fc1, down_proj -> linear_fc2."""
    return [
        Entry(L + m + "linear_fc1.weight", {"gate": H + hf + "gate_proj.weight", "up": H + hf + "up_proj.weight"},
              GatedMLP(), layers=layers, shape=lambda c: (c["intermediate_size"], c["hidden_size"])),
        Entry(L + m + "linear_fc2.weight", H + hf + "down_proj.weight", RowParallel(), layers=layers,
              shape=lambda c: (c["hidden_size"], c["intermediate_size"])),
    ]


def routed_experts(
    num_experts: int, *, layers: Callable[[int], bool] | None = None, router_bias: str | None = None
) -> list[Entry]:
    """Router + routed experts (SequentialMLP ``local_experts``), experts spread over EP and sharded over ETP."""
    ex = "mlp.experts.local_experts.*."
    out = [
        Entry(L + "mlp.router.weight", H + "mlp.gate.weight", Replicated(), layers=layers,
              shape=lambda c: (experts(c), c["hidden_size"])),
        Entry(L + ex + "linear_fc1.weight",
              {"gate": H + "mlp.experts.*.gate_proj.weight", "up": H + "mlp.experts.*.up_proj.weight"},
              Expert(GatedMLP(), num_experts), layers=layers,
              shape=lambda c: (c["moe_intermediate_size"], c["hidden_size"])),
        Entry(L + ex + "linear_fc2.weight", H + "mlp.experts.*.down_proj.weight",
              Expert(RowParallel(), num_experts), layers=layers,
              shape=lambda c: (c["hidden_size"], c["moe_intermediate_size"])),
    ]
    if router_bias:
        out.append(Entry(L + "mlp.router.expert_bias", H + f"mlp.gate.{router_bias}", Replicated(), layers=layers,
                         shape=lambda c: (experts(c),)))
    return out


def fused_experts(
    num_experts: int, *, hidden: int, ffn: int, layers: Callable[[int], bool] | None = None
) -> list[Entry]:
    """Router + routed experts that HF keeps as two 3-D tensors per layer (transformers' fused
    ``mlp.experts.gate_up_proj`` [E, 2I, H] or [E, H, 2I], gate before up, and ``mlp.experts.down_proj``
    [E, H, I] or [E, I, H]), split into SequentialMLP's per-expert ``linear_fc1`` / ``linear_fc2`` (exported
    in the ``[in, out]`` orientation of the published checkpoints)."""
    ex = "mlp.experts.local_experts.*."

    def gate_up(c: Sizes) -> list[tuple]:  # NOTE: either orientation (transformers' [E, 2I, H], the hub's [E, H, 2I])
        e, i, h = experts(c), 2 * c["moe_intermediate_size"], c["hidden_size"]
        return [(e, i, h), (e, h, i)]

    def down(c: Sizes) -> list[tuple]:
        e, i, h = experts(c), c["moe_intermediate_size"], c["hidden_size"]
        return [(e, h, i), (e, i, h)]

    return [
        Entry(L + "mlp.router.weight", H + "mlp.gate.weight", Replicated(), layers=layers,
              shape=lambda c: (experts(c), c["hidden_size"])),
        Entry(L + ex + "linear_fc1.weight", H + "mlp.experts.gate_up_proj",
              FusedExperts(GatedMLP(), num_experts, out_features=2 * ffn, in_features=hidden), layers=layers,
              shape=gate_up),
        Entry(L + ex + "linear_fc2.weight", H + "mlp.experts.down_proj",
              FusedExperts(RowParallel(), num_experts, out_features=hidden, in_features=ffn), layers=layers,
              shape=down),
    ]


def column(meg: str, hf: str, **kw) -> Entry:
    return Entry(L + meg, H + hf, ColumnParallel(), **kw)


def replicated(meg: str, hf: str, **kw) -> Entry:
    return Entry(L + meg, H + hf, Replicated(), **kw)


def decoder(h: HFConfig, *, divisible_by: int, qkv_bias: bool = False, qk_norm: bool = False) -> NameMap:
    """A Llama-layout decoder: embedding, per layer norms + GQA attention + SwiGLU MLP, final norm and head."""
    if h.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act '{h.get('hidden_act')}' is not supported (only 'silu')")
    first, last = ends(h, divisible_by=divisible_by)
    return NameMap(first + norms() + gqa_attention(h, qkv_bias=qkv_bias, qk_norm=qk_norm) + dense_mlp() + last)

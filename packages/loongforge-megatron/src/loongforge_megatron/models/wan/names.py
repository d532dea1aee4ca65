"""Wan: diffusers ``WanTransformer3DModel`` <-> our megatron Wan (``model.py``).

Heads split over TP: every query / key / value projection (and the image tokens' key / value) is column-parallel,
with its bias and its all-heads RMSNorm weight; the attention outputs and the MLP's second linear are
row-parallel (their biases whole); the MLP's first linear is column-parallel. Everything else (patch embedding,
timestep / text / image embedders, the blocks' modulation tables and cross-attention norms, the output head) is
held whole on every rank. The 3-D RoPE tables are buffers on both sides (not in the checkpoint). Pipeline
parallelism is not supported (the embedders and the head are placed on the first / last stage, one stage built).
"""

from __future__ import annotations

from collections.abc import Callable

from loongforge.checkpoint import ColumnParallel, Entry, NameMap, Replicated, RowParallel
from loongforge.errors import CheckpointError

from loongforge_megatron.conversion.sizes import Sizes
from loongforge_megatron.models.spec import HFConfig

L = "layers.*."
H = "blocks.*."
C = "condition_embedder."


def _arch(h: HFConfig):
    from loongforge_megatron.models.wan.arch import arch_from_diffusers

    try:
        return arch_from_diffusers(h)
    except ValueError as exc:
        raise CheckpointError(f"wan: {exc}".splitlines()[0]) from None


def _inner(c: Sizes):
    return c.get("num_attention_heads", 40) * c.get("attention_head_dim", 128)


def _linear(size_out: Callable[[Sizes], object], size_in: Callable[[Sizes], object]) -> dict[str, Callable]:
    """Shapes of a linear's weight and bias from its sizes."""
    return {"weight": lambda c: (size_out(c), size_in(c)), "bias": lambda c: (size_out(c),)}


def _pair(megatron: str, hf: str, rule_w, rule_b, shapes: dict[str, Callable], *, stage: str = "layer") -> list[Entry]:
    return [Entry(f"{megatron}.{p}", f"{hf}.{p}", rule, stage=stage, shape=shapes[p])
            for p, rule in (("weight", rule_w), ("bias", rule_b))]


def name_map(h: HFConfig, *, divisible_by: int = 128) -> NameMap:
    arch = _arch(h)
    inner = _inner
    col, row, rep = ColumnParallel(), RowParallel(), Replicated()
    square = _linear(inner, inner)
    ffn_in = _linear(lambda c: c.get("ffn_dim", 13824), inner)
    ffn_out = _linear(inner, lambda c: c.get("ffn_dim", 13824))
    vector = {"weight": lambda c: (_inner(c),), "bias": lambda c: (_inner(c),)}

    def patch(c: Sizes) -> tuple:
        pt, ph, pw = arch.patch_size
        return (_inner(c), c.get("in_channels", 16), pt, ph, pw)

    first = [
        Entry("patch_embedding.weight", "patch_embedding.weight", rep, stage="first", shape=patch),
        Entry("patch_embedding.bias", "patch_embedding.bias", rep, stage="first", shape=lambda c: (_inner(c),)),
        *_pair("time_embedder.linear_1", C + "time_embedder.linear_1", rep, rep,
               _linear(inner, lambda c: c.get("freq_dim", 256)), stage="first"),
        *_pair("time_embedder.linear_2", C + "time_embedder.linear_2", rep, rep, square, stage="first"),
        *_pair("time_proj", C + "time_proj", rep, rep, _linear(lambda c: 6 * _inner(c), inner), stage="first"),
        *_pair("text_embedder.linear_1", C + "text_embedder.linear_1", rep, rep,
               _linear(inner, lambda c: c.get("text_dim", 4096)), stage="first"),
        *_pair("text_embedder.linear_2", C + "text_embedder.linear_2", rep, rep, square, stage="first"),
    ]
    if arch.image_dim is not None:
        d = arch.image_dim
        norm_d = {"weight": lambda c: (d,), "bias": lambda c: (d,)}
        first += [
            *_pair("image_embedder.norm1", C + "image_embedder.norm1", rep, rep, norm_d, stage="first"),
            *_pair("image_embedder.proj", C + "image_embedder.ff.net.0.proj", rep, rep,
                   _linear(lambda c: d, lambda c: d), stage="first"),
            *_pair("image_embedder.out", C + "image_embedder.ff.net.2", rep, rep, _linear(inner, lambda c: d),
                   stage="first"),
            *_pair("image_embedder.norm2", C + "image_embedder.norm2", rep, rep, vector, stage="first"),
        ]
        if arch.pos_embed_seq_len:
            first.append(Entry("image_embedder.pos_embed", C + "image_embedder.pos_embed", rep, stage="first",
                               shape=lambda c: (1, c["pos_embed_seq_len"], d)))
    layers: list[Entry] = []
    for attn in ("attn1", "attn2"):
        for proj in ("to_q", "to_k", "to_v"):
            layers += _pair(f"{L}{attn}.{proj}", f"{H}{attn}.{proj}", col, col, square)
        layers += _pair(f"{L}{attn}.to_out", f"{H}{attn}.to_out.0", row, rep, square)
        for norm in ("norm_q", "norm_k"):
            layers.append(Entry(f"{L}{attn}.{norm}.weight", f"{H}{attn}.{norm}.weight", col, shape=vector["weight"]))
    if arch.added_kv_proj_dim is not None:
        kv = _linear(inner, lambda c: c["added_kv_proj_dim"])
        for proj in ("add_k_proj", "add_v_proj"):
            layers += _pair(f"{L}attn2.{proj}", f"{H}attn2.{proj}", col, col, kv)
        layers.append(Entry(f"{L}attn2.norm_added_k.weight", f"{H}attn2.norm_added_k.weight", col,
                            shape=vector["weight"]))
    if arch.cross_attn_norm:
        layers += _pair(f"{L}norm2", f"{H}norm2", rep, rep, vector)
    layers += [
        *_pair(f"{L}mlp.linear_fc1", f"{H}ffn.net.0.proj", col, col, ffn_in),
        *_pair(f"{L}mlp.linear_fc2", f"{H}ffn.net.2", row, rep, ffn_out),
        Entry(f"{L}scale_shift_table", f"{H}scale_shift_table", rep, shape=lambda c: (1, 6, _inner(c))),
    ]

    def out(c: Sizes) -> object:
        pt, ph, pw = arch.patch_size
        return (c.get("out_channels") or c.get("in_channels", 16)) * pt * ph * pw

    last = [
        *_pair("proj_out", "proj_out", rep, rep, _linear(out, inner), stage="last"),
        Entry("scale_shift_table", "scale_shift_table", rep, stage="last", shape=lambda c: (1, 2, _inner(c))),
    ]
    return NameMap(first + layers + last)


def text_config(h: HFConfig) -> HFConfig:
    """The layer count; a Wan model has no vocabulary (its text arrives as embeddings), so the one the converter's
    layout asks for is a single row."""
    return {"num_hidden_layers": _arch(h).num_layers, "vocab_size": 1}


def export_config(h: HFConfig) -> HFConfig:
    """The config.json an export writes: the source's keys with ours (diffusers' defaults filled in)."""
    from loongforge_megatron.models.wan.arch import diffusers_config

    return {**h, **diffusers_config(_arch(h))}

"""DiT: diffusers ``DiTTransformer2DModel`` <-> our megatron DiT (``engine/dit.py``).

diffusers keeps a copy of the timestep / class embedder in every block (``transformer_blocks.i.norm1.emb``; the
facebook/DiT-* conversions copy the one embedder of the original DiT into each); ours holds it once, so those
entries use the ``Shared`` rule (import refuses copies that differ, export writes one copy per block). The
position embedding is a fixed sin-cos buffer on both sides (not in the checkpoint). Pipeline parallelism is not
supported (embedders and the final layer are placed on the first / last stage but the model builds one stage).
"""

from __future__ import annotations

from collections.abc import Callable

from loongforge.checkpoint import ColumnParallel, Entry, FusedQKV, NameMap, Replicated, RowParallel, Shared
from loongforge.errors import CheckpointError

from loongforge_megatron.conversion.sizes import Size, Sizes
from loongforge_megatron.models.spec import HFConfig

L = "decoder.layers.*."
H = "transformer_blocks.*."
EMB = "transformer_blocks.{i}.norm1.emb."


def _arch(h: HFConfig):
    from loongforge_megatron.models.dit.arch import arch_from_diffusers

    try:
        return arch_from_diffusers(h)
    except ValueError as exc:
        raise CheckpointError(f"dit: {exc}".splitlines()[0]) from None


def _inner(c: Sizes) -> Size:
    """The blocks' width: num_attention_heads x attention_head_dim (diffusers' defaults 16 x 72)."""
    return c.get("num_attention_heads", 16) * c.get("attention_head_dim", 72)


def _shape(kind: str, rows: int = 1) -> Callable[[Sizes], tuple]:
    """An HF tensor's shape: ``kind`` square / wide (rows x inner, inner) / patch / timestep / classes / out, with
    its bias (``.bias``: the rows only)."""
    def shape(c: Sizes) -> tuple:
        inner = _inner(c)
        if kind == "patch":
            p = c["patch_size"]
            return (inner, c.get("in_channels", 4), p, p)
        if kind == "timestep":
            return (inner, 256)  # NOTE: diffusers' sinusoidal timestep projection has 256 channels
        if kind == "classes":
            return (c["num_embeds_ada_norm"] + 1, inner)  # NOTE: plus the null class (classifier-free guidance)
        if kind == "out":
            p = c["patch_size"]
            return (p * p * (c.get("out_channels") or c.get("in_channels", 4)), inner)
        if kind == "ffn_in":
            return (4 * inner, inner)
        if kind == "ffn_out":
            return (inner, 4 * inner)
        return (inner * rows, inner) if rows > 1 else (inner, inner)

    return shape


def _bias(weight: Callable[[Sizes], tuple]) -> Callable[[Sizes], tuple]:
    return lambda c: weight(c)[:1]


def _shared(megatron: str, hf: str, n: int, shape: Callable[[Sizes], tuple]) -> Entry:
    """One embedder tensor <-> its copy in each of the ``n`` blocks."""
    return Entry(megatron, {str(i): EMB.format(i=i) + hf for i in range(n)}, Shared(copies=n), stage="first",
                 shape=shape)


def name_map(h: HFConfig, *, divisible_by: int = 128) -> NameMap:
    arch = _arch(h)
    n = arch.num_layers
    qkv = FusedQKV(num_heads=arch.num_attention_heads, num_query_groups=arch.num_attention_heads,
                   head_dim=arch.head_dim)
    square, patch, out = _shape("square"), _shape("patch"), _shape("out")
    ffn_in, ffn_out, ada, final = _shape("ffn_in"), _shape("ffn_out"), _shape("wide", 6), _shape("wide", 2)
    step = {"linear_1": _shape("timestep"), "linear_2": square}
    first = [
        Entry("patch_embed.weight", "pos_embed.proj.weight", Replicated(), stage="first", shape=patch),
        Entry("patch_embed.bias", "pos_embed.proj.bias", Replicated(), stage="first", shape=_bias(patch)),
        *(_shared(f"t_embedder.{lin}.{p}", f"timestep_embedder.{lin}.{p}", n,
                  step[lin] if p == "weight" else _bias(step[lin]))
          for lin in ("linear_1", "linear_2") for p in ("weight", "bias")),
        _shared("y_embedder.embedding_table.weight", "class_embedder.embedding_table.weight", n, _shape("classes")),
    ]
    layers = [
        Entry(L + "adaln_modulation.weight", H + "norm1.linear.weight", ColumnParallel(), shape=ada),
        Entry(L + "adaln_modulation.bias", H + "norm1.linear.bias", ColumnParallel(), shape=_bias(ada)),
        *(Entry(L + f"self_attention.linear_qkv.{p}", {r: f"{H}attn1.to_{r}.{p}" for r in "qkv"}, qkv,
                shape=square if p == "weight" else _bias(square))
          for p in ("weight", "bias")),
        Entry(L + "self_attention.linear_proj.weight", H + "attn1.to_out.0.weight", RowParallel(), shape=square),
        Entry(L + "self_attention.linear_proj.bias", H + "attn1.to_out.0.bias", Replicated(), shape=_bias(square)),
        Entry(L + "mlp.linear_fc1.weight", H + "ff.net.0.proj.weight", ColumnParallel(), shape=ffn_in),
        Entry(L + "mlp.linear_fc1.bias", H + "ff.net.0.proj.bias", ColumnParallel(), shape=_bias(ffn_in)),
        Entry(L + "mlp.linear_fc2.weight", H + "ff.net.2.weight", RowParallel(), shape=ffn_out),
        Entry(L + "mlp.linear_fc2.bias", H + "ff.net.2.bias", Replicated(), shape=_bias(ffn_out)),
    ]
    last = [
        Entry("final_layer.adaln_modulation.weight", "proj_out_1.weight", ColumnParallel(), stage="last", shape=final),
        Entry("final_layer.adaln_modulation.bias", "proj_out_1.bias", ColumnParallel(), stage="last",
              shape=_bias(final)),
        Entry("final_layer.linear.weight", "proj_out_2.weight", Replicated(), stage="last", shape=out),
        Entry("final_layer.linear.bias", "proj_out_2.bias", Replicated(), stage="last", shape=_bias(out)),
    ]
    return NameMap(first + layers + last)


def text_config(h: HFConfig) -> HFConfig:
    """Layer count; the class table (classes + the null class) stands in for the vocabulary."""
    arch = _arch(h)
    return {"num_hidden_layers": arch.num_layers, "vocab_size": arch.num_classes + 1}


def export_config(h: HFConfig) -> HFConfig:
    """A legacy ``Transformer2DModel`` DiT config is written as the ``DiTTransformer2DModel`` it loads as."""
    from loongforge_megatron.models.dit.arch import diffusers_config

    return {**h, **diffusers_config(_arch(h))}

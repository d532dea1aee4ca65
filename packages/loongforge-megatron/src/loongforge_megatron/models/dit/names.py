"""DiT: diffusers ``DiTTransformer2DModel`` <-> our megatron DiT (``engine/dit.py``).

diffusers keeps a copy of the timestep / class embedder in every block (``transformer_blocks.i.norm1.emb``; the
facebook/DiT-* conversions copy the one embedder of the original DiT into each); ours holds it once, so those
entries use the ``Shared`` rule (import refuses copies that differ, export writes one copy per block). The
position embedding is a fixed sin-cos buffer on both sides (not in the checkpoint). Pipeline parallelism is not
supported (embedders and the final layer are placed on the first / last stage but the model builds one stage).
"""

from __future__ import annotations

from loongforge.checkpoint import ColumnParallel, Entry, FusedQKV, NameMap, Replicated, RowParallel, Shared
from loongforge.errors import CheckpointError

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


def _shared(megatron: str, hf: str, n: int) -> Entry:
    """One embedder tensor <-> its copy in each of the ``n`` blocks."""
    return Entry(megatron, {str(i): EMB.format(i=i) + hf for i in range(n)}, Shared(copies=n), stage="first")


def name_map(h: HFConfig, *, divisible_by: int = 128) -> NameMap:
    arch = _arch(h)
    n = arch.num_layers
    qkv = FusedQKV(num_heads=arch.num_attention_heads, num_query_groups=arch.num_attention_heads,
                   head_dim=arch.head_dim)
    first = [
        Entry("patch_embed.weight", "pos_embed.proj.weight", Replicated(), stage="first"),
        Entry("patch_embed.bias", "pos_embed.proj.bias", Replicated(), stage="first"),
        *(_shared(f"t_embedder.{lin}.{p}", f"timestep_embedder.{lin}.{p}", n)
          for lin in ("linear_1", "linear_2") for p in ("weight", "bias")),
        _shared("y_embedder.embedding_table.weight", "class_embedder.embedding_table.weight", n),
    ]
    layers = [
        Entry(L + "adaln_modulation.weight", H + "norm1.linear.weight", ColumnParallel()),
        Entry(L + "adaln_modulation.bias", H + "norm1.linear.bias", ColumnParallel()),
        *(Entry(L + f"self_attention.linear_qkv.{p}", {r: f"{H}attn1.to_{r}.{p}" for r in "qkv"}, qkv)
          for p in ("weight", "bias")),
        Entry(L + "self_attention.linear_proj.weight", H + "attn1.to_out.0.weight", RowParallel()),
        Entry(L + "self_attention.linear_proj.bias", H + "attn1.to_out.0.bias", Replicated()),
        Entry(L + "mlp.linear_fc1.weight", H + "ff.net.0.proj.weight", ColumnParallel()),
        Entry(L + "mlp.linear_fc1.bias", H + "ff.net.0.proj.bias", ColumnParallel()),
        Entry(L + "mlp.linear_fc2.weight", H + "ff.net.2.weight", RowParallel()),
        Entry(L + "mlp.linear_fc2.bias", H + "ff.net.2.bias", Replicated()),
    ]
    last = [
        Entry("final_layer.adaln_modulation.weight", "proj_out_1.weight", ColumnParallel(), stage="last"),
        Entry("final_layer.adaln_modulation.bias", "proj_out_1.bias", ColumnParallel(), stage="last"),
        Entry("final_layer.linear.weight", "proj_out_2.weight", Replicated(), stage="last"),
        Entry("final_layer.linear.bias", "proj_out_2.bias", Replicated(), stage="last"),
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

"""Qwen-Image: diffusers ``QwenImageTransformer2DModel`` <-> our megatron Qwen-Image (``model.py``).

Heads split over TP: both streams' query / key / value projections are column-parallel (with their biases), their
output projections row-parallel (biases whole); each MLP's first linear is column-parallel, its second row-parallel;
the blocks' modulation linears are column-parallel (their outputs gathered). The per-head q / k RMSNorm weights,
the embedders and the output head are held whole on every rank. RoPE has no weights. Pipeline parallelism is not
supported (the embedders and the head are placed on the first / last stage, one stage built).
"""

from __future__ import annotations

from collections.abc import Callable

from loongforge.checkpoint import ColumnParallel, Entry, NameMap, Replicated, RowParallel
from loongforge.errors import CheckpointError

from loongforge_megatron.conversion.sizes import Sizes
from loongforge_megatron.models.spec import HFConfig

L = "layers.*."
H = "transformer_blocks.*."


def _arch(h: HFConfig):
    from loongforge_megatron.models.qwen_image.arch import arch_from_diffusers

    try:
        return arch_from_diffusers(h)
    except ValueError as exc:
        raise CheckpointError(f"qwen_image: {exc}".splitlines()[0]) from None


def _linear(size_out: Callable[[Sizes], object], size_in: Callable[[Sizes], object]) -> dict[str, Callable]:
    """Shapes of a linear's weight and bias from its sizes."""
    return {"weight": lambda c: (size_out(c), size_in(c)), "bias": lambda c: (size_out(c),)}


def _pair(megatron: str, hf: str, rule_w, rule_b, shapes: dict[str, Callable], *, stage: str = "layer") -> list[Entry]:
    return [Entry(f"{megatron}.{p}", f"{hf}.{p}", rule, stage=stage, shape=shapes[p])
            for p, rule in (("weight", rule_w), ("bias", rule_b))]


def name_map(h: HFConfig, *, divisible_by: int = 128) -> NameMap:
    arch = _arch(h)
    hid, head, ffn = (lambda c: arch.hidden_size), (lambda c: arch.head_dim), (lambda c: arch.ffn_hidden_size)
    text, out = (lambda c: arch.joint_attention_dim), (lambda c: arch.patch_size**2 * arch.out_channels)
    col, row, rep = ColumnParallel(), RowParallel(), Replicated()
    square = _linear(hid, hid)
    first = [
        *_pair("img_in", "img_in", rep, rep, _linear(hid, lambda c: arch.in_channels), stage="first"),
        Entry("txt_norm.weight", "txt_norm.weight", rep, stage="first", shape=lambda c: (text(c),)),
        *_pair("txt_in", "txt_in", rep, rep, _linear(hid, text), stage="first"),
        *_pair("time_embedder.linear_1", "time_text_embed.timestep_embedder.linear_1", rep, rep,
               _linear(hid, lambda c: 256), stage="first"),
        *_pair("time_embedder.linear_2", "time_text_embed.timestep_embedder.linear_2", rep, rep, square,
               stage="first"),
    ]
    layers: list[Entry] = []
    for stream in ("img", "txt"):
        layers += _pair(f"{L}{stream}_mod", f"{H}{stream}_mod.1", col, col, _linear(lambda c: 6 * hid(c), hid))
        layers += _pair(f"{L}{stream}_mlp.linear_fc1", f"{H}{stream}_mlp.net.0.proj", col, col, _linear(ffn, hid))
        layers += _pair(f"{L}{stream}_mlp.linear_fc2", f"{H}{stream}_mlp.net.2", row, rep, _linear(hid, ffn))
    for proj in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
        layers += _pair(f"{L}attn.{proj}", f"{H}attn.{proj}", col, col, square)
    layers += _pair(f"{L}attn.to_out", f"{H}attn.to_out.0", row, rep, square)
    layers += _pair(f"{L}attn.to_add_out", f"{H}attn.to_add_out", row, rep, square)
    for ours, theirs in (("q_layernorm", "norm_q"), ("k_layernorm", "norm_k"), ("added_q_layernorm", "norm_added_q"),
                         ("added_k_layernorm", "norm_added_k")):
        layers.append(Entry(f"{L}attn.{ours}.weight", f"{H}attn.{theirs}.weight", rep, shape=lambda c: (head(c),)))
    last = [
        *_pair("norm_out_linear", "norm_out.linear", rep, rep, _linear(lambda c: 2 * hid(c), hid), stage="last"),
        *_pair("proj_out", "proj_out", rep, rep, _linear(out, hid), stage="last"),
    ]
    return NameMap(first + layers + last)


def text_config(h: HFConfig) -> HFConfig:
    """The layer count; a Qwen-Image transformer has no vocabulary (its text arrives as hidden states), so the one
    the converter's layout asks for is a single row."""
    return {"num_hidden_layers": _arch(h).num_layers, "vocab_size": 1}


def export_config(h: HFConfig) -> HFConfig:
    """The config.json an export writes: the source's keys with ours (diffusers' defaults filled in)."""
    from loongforge_megatron.models.qwen_image.arch import diffusers_config

    return {**h, **diffusers_config(_arch(h))}

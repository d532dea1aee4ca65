"""Phi-3 as a LoongForge megatron model family, from outside the backend (an example of ``docs/models.md``).

Phi-3 is a Llama-shaped decoder (RMSNorm, SwiGLU, RoPE, GQA) whose HF checkpoint fuses the projections:
``self_attn.qkv_proj`` holds [q; k; v] and ``mlp.gate_up_proj`` holds [gate; up], one tensor each, where
Llama has three and two. So the family reuses the GPT kind (megatron's GPTModel, its data, checks and forward
step) and brings its presets, its HF config fields both ways and its name map, with two rules that split the
fused HF tensors into the shapes megatron's fused ``linear_qkv`` (GQA interleave) and ``linear_fc1`` take.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongforge.checkpoint import Entry, FusedQKV, GatedMLP, NameMap, RowParallel
from loongforge.checkpoint.mapping import SINGLE, Rule
from loongforge.errors import RecipeError
from loongforge_megatron.config import ModelConfig
from loongforge_megatron.models.gpt.family import GPTFamily
from loongforge_megatron.models.gpt.names import H, L, ends, head_dim, norms, num_query_groups
from pydantic import Field

PRESETS = {
    "phi3-mini": dict(family="phi3", num_layers=32, hidden_size=3072, ffn_hidden_size=8192, num_attention_heads=32,
                      vocab_size=32064, max_position_embeddings=4096, rope_theta=10000.0, sliding_window=2047),
    "phi3-tiny": dict(family="phi3", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                      num_query_groups=2, vocab_size=512, max_position_embeddings=256),
}
RECIPE = Path(__file__).with_name("phi3_tiny.yaml")  # a tiny CPU recipe of this family


class ConcatenatedQKV(Rule):
    """HF ``qkv_proj`` = [q; k; v] (dim 0)  <->  megatron ``linear_qkv``: split, then :class:`FusedQKV`'s
    GQA interleave and its TP split by query groups."""

    row_wise = True

    def __init__(self, *, num_heads: int, num_query_groups: int, head_dim: int):
        self.qkv = FusedQKV(num_heads=num_heads, num_query_groups=num_query_groups, head_dim=head_dim)
        self.sizes = [num_heads * head_dim, num_query_groups * head_dim, num_query_groups * head_dim]

    def to_megatron(self, hf_tensors, *, tp_rank, tp_size):
        q, k, v = hf_tensors[SINGLE].split(self.sizes, dim=0)
        return self.qkv.to_megatron({"q": q, "k": k, "v": v}, tp_rank=tp_rank, tp_size=tp_size)

    def to_hf(self, shards):
        import torch

        parts = self.qkv.to_hf(shards)
        return {SINGLE: torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)}


class ConcatenatedGateUp(Rule):
    """HF ``gate_up_proj`` = [gate; up] (dim 0)  <->  megatron ``linear_fc1``: each TP rank holds
    [gate shard; up shard] (:class:`GatedMLP`)."""

    row_wise = True

    def __init__(self) -> None:
        self.gated = GatedMLP()

    def to_megatron(self, hf_tensors, *, tp_rank, tp_size):
        gate, up = hf_tensors[SINGLE].chunk(2, dim=0)
        return self.gated.to_megatron({"gate": gate, "up": up}, tp_rank=tp_rank, tp_size=tp_size)

    def to_hf(self, shards):
        import torch

        parts = self.gated.to_hf(shards)
        return {SINGLE: torch.cat([parts["gate"], parts["up"]], dim=0)}


class Phi3ModelConfig(ModelConfig):
    """The recipe's ``model`` section of a Phi-3: the shared keys plus the family's own."""

    sliding_window: int | None = Field(None, ge=1, description="Phi-3: the attention window in tokens (phi3-mini: "
                                       "2047); data.seq_length may not exceed it")


class Phi3(GPTFamily):
    """``Phi3ForCausalLM`` (transformers' own model) <-> megatron's GPTModel."""

    name = "phi3"
    model_types = ("phi3",)
    presets = PRESETS
    hf_architecture = "Phi3ForCausalLM"
    model_section = Phi3ModelConfig  # NOTE: model.sliding_window, an architecture key of this family only

    def read_hf(self, cfg: dict, fields: dict[str, Any], *, path: Path) -> dict[str, Any]:
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise RecipeError(f"{path}: Phi-3 with partial_rotary_factor {cfg['partial_rotary_factor']} is not "
                              "supported (rotary over the whole head only)", key="model.hf")
        fields["sliding_window"] = cfg.get("sliding_window")
        return fields

    def write_hf(self, arch, cfg: dict) -> dict:
        cfg.pop("head_dim")  # NOTE: Phi3Config derives it (hidden / heads)
        cfg.update(sliding_window=arch.sliding_window, partial_rotary_factor=1.0, resid_pdrop=0.0,
                   embd_pdrop=0.0, original_max_position_embeddings=arch.max_position_embeddings,
                   # NOTE: Phi3Config's default pad id (32000) is a row of Phi-3's own 32064-token table only
                   pad_token_id=32000 if arch.vocab_size > 32000 else None)
        return cfg

    def name_map(self, cfg: dict, *, divisible_by: int = 128) -> NameMap:
        first, last = ends(cfg, divisible_by=divisible_by)
        qkv = ConcatenatedQKV(num_heads=cfg["num_attention_heads"], num_query_groups=num_query_groups(cfg),
                              head_dim=head_dim(cfg))
        layers = [
            Entry(L + "self_attention.linear_qkv.weight", H + "self_attn.qkv_proj.weight", qkv),
            Entry(L + "self_attention.linear_proj.weight", H + "self_attn.o_proj.weight", RowParallel()),
            Entry(L + "mlp.linear_fc1.weight", H + "mlp.gate_up_proj.weight", ConcatenatedGateUp()),
            Entry(L + "mlp.linear_fc2.weight", H + "mlp.down_proj.weight", RowParallel()),
        ]
        return NameMap(first + norms() + layers + last)


SPEC = Phi3()

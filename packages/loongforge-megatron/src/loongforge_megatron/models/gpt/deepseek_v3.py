"""DeepSeek-V3 (and V2-style MLA): multi-latent attention, ``first_k_dense_replace`` dense layers, then MoE
layers with a sigmoid router carrying ``e_score_correction_bias`` and shared experts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from loongforge.checkpoint import ColumnParallel, Copies, Entry, GatedMLP, NameMap, Replicated, RowParallel
from loongforge.errors import CheckpointError, RecipeError

from loongforge_megatron.conversion.sizes import Size, Sizes
from loongforge_megatron.models.gpt.arch import Arch
from loongforge_megatron.models.gpt.family import GPTFamily
from loongforge_megatron.models.gpt.names import (
    H,
    HFConfig,
    L,
    column,
    dense_mlp,
    ends,
    norms,
    replicated,
    routed_experts,
)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

PRESETS: dict[str, dict[str, Any]] = {
    # MLA + MoE with a shared expert, sigmoid routing with expert bias, grouped top-k
    "deepseek-v3": dict(family="deepseek_v3", num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128, vocab_size=129280, max_position_embeddings=163840, rope_theta=10000.0, norm_eps=1e-6,
                        num_experts=256, moe_topk=8, moe_ffn_hidden_size=2048, moe_shared_expert_ffn=2048, moe_first_dense_layers=3, moe_score_function="sigmoid", moe_expert_bias=True, moe_routed_scaling=2.5, moe_num_groups=8, moe_group_topk=4,
                        q_lora_rank=1536, kv_lora_rank=512, qk_norm=True, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    "deepseek-v3-tiny": dict(family="deepseek_v3", num_layers=3, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, vocab_size=512, max_position_embeddings=256, norm_eps=1e-6,
                             num_experts=4, moe_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_ffn=32, moe_first_dense_layers=1, moe_score_function="sigmoid", moe_expert_bias=True, moe_routed_scaling=2.5, moe_num_groups=2, moe_group_topk=1,
                             q_lora_rank=32, kv_lora_rank=16, qk_norm=True, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
}


def is_moe_layer(h: HFConfig, layer: int) -> bool:
    freq = h.get("moe_layer_freq", 1) or 1
    return h["n_routed_experts"] > 0 and layer >= h.get("first_k_dense_replace", 0) and layer % freq == 0


def _q_head(c: Sizes) -> Size:
    return c["qk_nope_head_dim"] + c["qk_rope_head_dim"]


def mla_attention(h: HFConfig) -> list[Entry]:
    """MLA projections: all column-parallel in the local spec (down projections are gathered after the matmul)."""
    a = "self_attention."
    heads = "num_attention_heads"
    out = []
    if h.get("q_lora_rank") is None:
        out.append(column(a + "linear_q_proj.weight", "self_attn.q_proj.weight",
                          shape=lambda c: (c[heads] * _q_head(c), c["hidden_size"])))
    else:
        out += [
            column(a + "linear_q_down_proj.weight", "self_attn.q_a_proj.weight",
                   shape=lambda c: (c["q_lora_rank"], c["hidden_size"])),
            replicated(a + "q_layernorm.weight", "self_attn.q_a_layernorm.weight", shape=lambda c: (c["q_lora_rank"],)),
            column(a + "linear_q_up_proj.weight", "self_attn.q_b_proj.weight",
                   shape=lambda c: (c[heads] * _q_head(c), c["q_lora_rank"])),
        ]
    out += [
        column(a + "linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
               shape=lambda c: (c["kv_lora_rank"] + c["qk_rope_head_dim"], c["hidden_size"])),
        replicated(a + "kv_layernorm.weight", "self_attn.kv_a_layernorm.weight", shape=lambda c: (c["kv_lora_rank"],)),
        column(a + "linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight",
               shape=lambda c: (c[heads] * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])),
        Entry(L + a + "linear_proj.weight", H + "self_attn.o_proj.weight", RowParallel(),
              shape=lambda c: (c["hidden_size"], c[heads] * c["v_head_dim"])),
    ]
    return out


def mtp_depths(h: HFConfig) -> int:
    """The multi-token-prediction layers a name map covers (the checkpoint's layout says how many it holds)."""
    return h.get("num_nextn_predict_layers") or 0


def with_mtp(h: HFConfig, first: list[Entry], layer: list[Entry], last: list[Entry]) -> list[Entry]:
    """DeepSeek-V3's HF layout of multi-token prediction: layer ``num_hidden_layers + k`` holds depth k's
    ``enorm`` / ``hnorm`` / ``eh_proj``, a decoder layer (``layer``'s entries) and ``shared_head.norm``, plus
    copies of the embedding and the output head; megatron's ``mtp.layers.k`` shares the model's own."""
    depths = mtp_depths(h)
    if not depths:
        return first + layer + last
    n = h["num_hidden_layers"]

    def copies(e: Entry, hf_in_mtp: str, **kw) -> Entry:
        names = {"0": e.hf, **{str(1 + k): f"model.layers.{n + k}.{hf_in_mtp}" for k in range(depths)}}
        return Entry(e.megatron, names, Copies(e.rule, 1 + depths),
                     **{"stage": e.stage, "export": e.export, "shape": e.shape, **kw})

    emb = first[0]
    out = [copies(emb, "embed_tokens.weight")]
    # NOTE: the last stage's own embedding copy (megatron syncs it with the first stage's like a tied head)
    out.append(copies(emb, "embed_tokens.weight", stage="mtp_copy", export=False))
    m = "mtp.layers.*."
    out += layer + [
        Entry(m + "enorm.weight", H + "enorm.weight", Replicated(), stage="mtp", shape=_hidden),
        Entry(m + "hnorm.weight", H + "hnorm.weight", Replicated(), stage="mtp", shape=_hidden),
        Entry(m + "eh_proj.weight", H + "eh_proj.weight", ColumnParallel(), stage="mtp",
              shape=lambda c: (c["hidden_size"], 2 * c["hidden_size"])),
        Entry(m + "final_layernorm.weight", H + "shared_head.norm.weight", Replicated(), stage="mtp", shape=_hidden),
    ]
    out += [Entry(e.megatron.replace(L, m + "mtp_model_layer.", 1), e.hf, e.rule, stage="mtp", layers=e.layers,
                  export=e.export, shape=e.shape) for e in layer]
    for e in last:
        out.append(copies(e, "shared_head.head.weight") if e.megatron == "output_layer.weight" else e)
    return out


def _hidden(c: Sizes) -> tuple:
    return (c["hidden_size"],)


def _shared_ffn(c: Sizes) -> Size:
    return c["moe_intermediate_size"] * c.get("n_shared_experts", 1)


def mlp(h: HFConfig) -> list[Entry]:
    """DeepSeek-style MLPs: dense in the first ``first_k_dense_replace`` layers, then a router with
    ``e_score_correction_bias``, routed experts and shared experts (GLM-4.5 lays them out the same way)."""

    def moe(i: int) -> bool:
        return is_moe_layer(h, i)

    def dense(i: int) -> bool:
        return not is_moe_layer(h, i)

    shared = []
    if h.get("n_shared_experts"):
        s = "mlp.shared_experts."
        shared = [
            Entry(L + s + "linear_fc1.weight", {"gate": H + s + "gate_proj.weight", "up": H + s + "up_proj.weight"},
                  GatedMLP(), layers=moe, shape=lambda c: (_shared_ffn(c), c["hidden_size"])),
            Entry(L + s + "linear_fc2.weight", H + s + "down_proj.weight", RowParallel(), layers=moe,
                  shape=lambda c: (c["hidden_size"], _shared_ffn(c))),
        ]
    experts = routed_experts(h["n_routed_experts"], layers=moe, router_bias="e_score_correction_bias")
    return dense_mlp(layers=dense) + experts + shared


def name_map(h: HFConfig, *, divisible_by: int = 128) -> NameMap:
    first, last = ends(h, divisible_by=divisible_by)
    return NameMap(with_mtp(h, first, norms() + mla_attention(h) + mlp(h), last))


def mtp_layers_in(h: HFConfig, names: list[str]) -> int:
    """MTP layers present in a checkpoint: the layers after num_hidden_layers that have an ``eh_proj``. A layer
    after num_hidden_layers without one is a decoder layer the config does not count (refused: ignored as an MTP
    layer it would silently drop from the model)."""
    n = h["num_hidden_layers"]
    layers = {int(m.group(1)) for name in names if (m := _LAYER.match(name))}
    found = {int(m.group(1)) for name in names if (m := _LAYER.match(name)) and name.endswith(".eh_proj.weight")}
    stray = sorted(i for i in layers if i >= n and i not in found)
    if stray:
        raise CheckpointError(f"num_hidden_layers {n} does not match the weights: they hold decoder layer {stray[0]} "
                              f"(layers 0..{max(layers)}; multi-token-prediction layers have an eh_proj)")
    return len([i for i in found if i >= n])


def _ignore(h: HFConfig, name: str) -> bool:
    # NOTE: released DeepSeek-V3 checkpoints carry multi-token-prediction layers past num_hidden_layers.
    m = _LAYER.match(name)
    return "rotary_emb.inv_freq" in name or (m is not None and int(m.group(1)) >= h["num_hidden_layers"])


class DeepSeekMoEFamily(GPTFamily):
    """What DeepSeek-style MoE checkpoints share (DeepSeek-V3, Kimi-K2, GLM-4.5): ``n_routed_experts``, MTP layers
    after the decoder's (``layers.{num_hidden_layers + k}``) and an untied head in each of them."""

    layout_name = "DeepSeek-V3"  # for the errors

    def num_experts(self, cfg: HFConfig) -> int:
        return cfg["n_routed_experts"]

    def ignore_hf(self, cfg: HFConfig, name: str) -> bool:
        return _ignore(cfg, name)

    def mtp_layers_in(self, cfg: HFConfig, names: list[str]) -> int:
        return mtp_layers_in(cfg, names)

    def check_family(self, recipe: Any, plan: Any, arch: Arch) -> None:
        """MTP's HF layout repeats an untied head."""
        if arch.mtp_num_layers and arch.tie_embeddings:
            raise RecipeError(f"model.mtp_num_layers with tied embeddings has no {self.layout_name} HF layout (its MTP "
                              "layers carry a separate shared_head.head); untie them or leave MTP out",
                              key="model.mtp_num_layers")


class DeepseekV3(DeepSeekMoEFamily):
    """``DeepseekV3ForCausalLM`` (a DeepSeek-V2 checkpoint converts with the same map)."""

    name = "deepseek_v3"
    model_types = ("deepseek_v3", "deepseek_v2")
    presets = PRESETS
    hf_architecture = "DeepseekV3ForCausalLM"
    mla_yarn = True
    mtp = True
    trained_types = ("deepseek_v3",)  # DeepSeek-V2 checkpoints convert, but train with another router

    def read_hf(self, cfg: dict, fields: dict[str, Any], *, path: Path) -> dict[str, Any]:
        if cfg.get("model_type") not in self.trained_types:
            raise RecipeError(f"model_type '{cfg.get('model_type')}' in {path} is not supported for training; "
                              f"supported: {', '.join(self.trained_types)}", key="model.hf")
        fields.pop("head_dim")
        fields.update(
            num_query_groups=cfg["num_attention_heads"],
            qk_norm=True,  # MLA's q_a_layernorm / kv_a_layernorm
            num_experts=cfg["n_routed_experts"],
            moe_topk=cfg["num_experts_per_tok"],
            moe_ffn_hidden_size=cfg["moe_intermediate_size"],
            moe_shared_expert_ffn=cfg["moe_intermediate_size"] * cfg.get("n_shared_experts", 1),
            moe_first_dense_layers=cfg.get("first_k_dense_replace", 0),
            moe_score_function="sigmoid",
            moe_expert_bias=True,
            moe_norm_topk=bool(cfg.get("norm_topk_prob", True)),
            moe_routed_scaling=cfg.get("routed_scaling_factor", 1.0),
            moe_num_groups=cfg.get("n_group"),
            moe_group_topk=cfg.get("topk_group"),
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
        )
        return fields

    def write_hf(self, arch: Arch, cfg: dict) -> dict:
        cfg.pop("head_dim")
        cfg.update(n_routed_experts=arch.num_experts, num_experts_per_tok=arch.moe_topk, moe_intermediate_size=arch.moe_ffn_hidden_size,
                   n_shared_experts=(arch.moe_shared_expert_ffn or 0) // (arch.moe_ffn_hidden_size or 1),
                   first_k_dense_replace=arch.moe_first_dense_layers, norm_topk_prob=arch.moe_norm_topk,
                   routed_scaling_factor=arch.moe_routed_scaling or 1.0, n_group=arch.moe_num_groups or 1,
                   topk_group=arch.moe_group_topk or 1, q_lora_rank=arch.q_lora_rank, kv_lora_rank=arch.kv_lora_rank,
                   qk_nope_head_dim=arch.qk_nope_head_dim, qk_rope_head_dim=arch.qk_rope_head_dim, v_head_dim=arch.v_head_dim,
                   rope_interleave=True, scoring_func="sigmoid", topk_method="noaux_tc",
                   num_nextn_predict_layers=arch.mtp_num_layers)
        return cfg

    def name_map(self, cfg: HFConfig, *, divisible_by: int = 128) -> NameMap:
        return name_map(cfg, divisible_by=divisible_by)



SPEC = DeepseekV3()

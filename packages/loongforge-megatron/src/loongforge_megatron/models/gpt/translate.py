"""What every GPT family shares: an :class:`Arch` from / to the fields of a transformers decoder config, and the
megatron-core TransformerConfig of an :class:`Arch` (each family file adds its own fields on both sides)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from loongforge.errors import RecipeError

from loongforge_megatron.models.gpt.arch import Arch


def _rope_params(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from an HF config dict (transformers 4.x and 5.x spellings)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    return float(theta), scaling


# HF DeepSeek's YaRN defaults (modeling_deepseek_v3 / transformers' _compute_yarn_parameters)
YARN_DEFAULTS = {"original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                 "mscale_all_dim": 0.0}


def _yarn_attention_factor(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """transformers' YaRN cos/sin factor when the config gives none (``_compute_yarn_parameters``)."""
    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    return get(factor, mscale) / get(factor, mscale_all_dim) if mscale and mscale_all_dim else get(factor)


def _gpt_yarn(scaling: dict[str, Any], cfg: dict[str, Any], path: Path) -> dict[str, float]:
    """YaRN of a llama / qwen config as megatron's GPT ``yarn`` embedding takes it: the same frequencies (factor,
    original context, betas, the correction range rounded or not: ``truncate``) and the same cos/sin factor,
    expressed as megatron's (mscale, mscale_all_dim) pair. transformers uses that pair only when both are nonzero;
    otherwise its factor is ``0.1 ln(factor) + 1``, which is megatron's (1, 0)."""
    original = scaling.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 4096)
    factor = scaling.get("factor") or cfg.get("max_position_embeddings", original) / original
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if not (mscale and all_dim):
        mscale, all_dim = 1.0, 0.0
    given = scaling.get("attention_factor")
    if given is not None and abs(float(given) - _yarn_attention_factor(factor, mscale, all_dim)) > 1e-9:
        raise RecipeError(f"{path}: rope_scaling attention_factor {given} differs from YaRN's own "
                          f"({_yarn_attention_factor(factor, mscale, all_dim):.6g} for factor {factor}); megatron's "
                          "YaRN cannot take another value", key="model.hf")
    return {"factor": float(factor), "original_max_position_embeddings": float(original),
            "beta_fast": float(scaling.get("beta_fast") or 32), "beta_slow": float(scaling.get("beta_slow") or 1),
            "mscale": float(mscale), "mscale_all_dim": float(all_dim),
            "truncate": float(bool(scaling.get("truncate", True)))}


def arch_fields(cfg: dict[str, Any], path: Path, *, family: str, mla_yarn: bool = False) -> dict[str, Any]:
    """The :class:`Arch` fields every transformers decoder config gives (sizes, RoPE and its scaling, norms,
    tied embeddings); a family adds its own (biases, q/k norms, experts, MLA). ``mla_yarn``: YaRN as megatron's
    MLA takes it (HF DeepSeek's), else as its GPT ``yarn`` embedding does."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise RecipeError(f"{path}: hidden_act '{cfg.get('hidden_act')}' is not supported (only 'silu')",
                          key="model.hf")
    theta, scaling = _rope_params(cfg)
    heads = cfg["num_attention_heads"]
    fields: dict[str, Any] = dict(
        family=family,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rope_theta=theta,
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        init_std=cfg.get("initializer_range", 0.02),
    )
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if kind == "yarn" and mla_yarn:
        # NOTE: megatron's MLA has HF DeepSeek's YaRN (frequencies and the softmax-scale / cos-sin mscale)
        fields["rope_yarn"] = {k: float(scaling.get(k, d)) for k, d in YARN_DEFAULTS.items()}
        fields["rope_yarn"]["factor"] = float(scaling["factor"])
    elif kind == "yarn":
        fields["rope_yarn"] = _gpt_yarn(scaling, cfg, path)
    elif kind not in (None, "default", "llama3"):
        # NOTE: training with plain RoPE instead (what this used to do) silently changes the model: linear / dynamic
        # scale the positions
        raise RecipeError(f"{path}: rope_scaling type '{kind}' is not supported by the megatron backend yet "
                          "(supported: llama3, yarn)", key="model.hf")
    if kind == "llama3":
        fields["rope_scaling_factor"] = float(scaling["factor"])
        fields["rope_original_max_position"] = int(scaling.get("original_max_position_embeddings", 8192))
    if cfg.get("use_sliding_window"):
        # NOTE: Qwen configs carry a sliding_window that only use_sliding_window enables
        fields["sliding_window"] = cfg.get("sliding_window")
        if cfg.get("max_window_layers") is not None:
            fields["max_window_layers"] = cfg["max_window_layers"]
    return fields


def hf_fields(arch: Arch, *, architecture: str, model_type: str, torch_dtype: str) -> dict[str, Any]:
    """The transformers config fields every GPT family writes; the family adds its own."""
    cfg: dict[str, Any] = dict(
        architectures=[architecture],
        model_type=model_type,
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.ffn_hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.kv_heads,
        head_dim=arch.kv_channels,
        hidden_act="silu",
        max_position_embeddings=arch.max_position_embeddings,
        initializer_range=arch.init_std,
        rms_norm_eps=arch.norm_eps,
        rope_theta=arch.rope_theta,
        tie_word_embeddings=arch.tie_embeddings,
        attention_dropout=0.0,
        torch_dtype=torch_dtype,
        use_cache=True,
    )
    if arch.rope_yarn:
        y = arch.rope_yarn
        cfg["rope_scaling"] = {"type": "yarn", "rope_type": "yarn", **y,
                               "original_max_position_embeddings": int(y["original_max_position_embeddings"])}
        if "truncate" in y:
            cfg["rope_scaling"]["truncate"] = bool(y["truncate"])
    if arch.rope_scaling_factor:
        cfg["rope_scaling"] = dict(rope_type="llama3", factor=arch.rope_scaling_factor, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=arch.rope_original_max_position or 8192)
    return cfg


def transformer_config(arch: Arch, *, plan: Any, precision: str, cpu_init: bool, moe_dispatcher: str | None = None,
                       grad_accum_fusion: bool = False):
    """megatron-core ``TransformerConfig`` (or ``MLATransformerConfig``) for ``arch`` under ``plan``."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    kw: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.kv_heads,
        kv_channels=arch.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.init_std,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=grad_accum_fusion,
        persist_layer_norm=False,
        tensor_model_parallel_size=plan.tp,
        pipeline_model_parallel_size=plan.pp,
        virtual_pipeline_model_parallel_size=plan.vpp if plan.vpp > 1 else None,
        num_layers_in_first_pipeline_stage=plan.first_stage_layers,
        num_layers_in_last_pipeline_stage=plan.last_stage_layers,
        context_parallel_size=plan.cp,
        expert_model_parallel_size=plan.ep,
        expert_tensor_parallel_size=plan.etp,
        sequence_parallel=plan.sp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        use_cpu_initialization=cpu_init,
        calculate_per_token_loss=True,
        variable_seq_lengths=False,
    )
    if arch.mtp_num_layers:
        kw.update(mtp_num_layers=arch.mtp_num_layers, mtp_loss_scaling_factor=arch.mtp_loss_weight)
    if plan.recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=plan.recompute_layers or 1)
    elif plan.recompute == "selective":
        kw.update(recompute_granularity="selective")
    if arch.is_moe:
        first = arch.moe_first_dense_layers
        kw.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size or arch.ffn_hidden_size,
            moe_shared_expert_intermediate_size=arch.moe_shared_expert_ffn,
            moe_layer_freq=[0] * first + [1] * (arch.num_layers - first),
            moe_router_load_balancing_type=arch.moe_aux_loss_type if arch.moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=arch.moe_aux_loss_coeff,
            moe_z_loss_coeff=arch.moe_z_loss_coeff,
            # NOTE: the permute dispatcher is installed by the layer spec in place of megatron's all-to-all one
            moe_token_dispatcher_type=moe_dispatcher or (
                "allgather" if arch.moe_token_dispatcher == "allgather" else "alltoall"),
            moe_expert_capacity_factor=arch.moe_capacity_factor,
            moe_token_drop_policy=arch.moe_token_drop_policy,
            moe_pad_expert_input_to_capacity=arch.moe_pad_to_capacity,
            moe_router_score_function=arch.moe_score_function,
            moe_router_enable_expert_bias=arch.moe_expert_bias,
            moe_router_bias_update_rate=arch.moe_expert_bias_update_rate,
            moe_router_topk_scaling_factor=arch.moe_routed_scaling,
            moe_router_num_groups=arch.moe_num_groups,
            moe_router_group_topk=arch.moe_group_topk,
            moe_router_pre_softmax=not arch.moe_norm_topk and arch.moe_score_function == "softmax",
            moe_router_dtype="fp32",
            moe_shared_expert_overlap=arch.moe_shared_expert_overlap,
            moe_grouped_gemm=False,
        )
    if arch.is_mla:
        kw.pop("kv_channels")
        kw.update(
            multi_latent_attention=True,
            q_lora_rank=arch.q_lora_rank,
            kv_lora_rank=arch.kv_lora_rank,
            qk_head_dim=arch.qk_nope_head_dim,
            qk_pos_emb_head_dim=arch.qk_rope_head_dim,
            v_head_dim=arch.v_head_dim,
            rope_type="rope",
            rotary_base=arch.rope_theta,
            rotary_scaling_factor=1.0,
            mscale=1.0,
            mscale_all_dim=0.0,
        )
        if arch.rope_yarn:
            y = arch.rope_yarn
            kw.update(rope_type="yarn", rotary_scaling_factor=y["factor"], mscale=y["mscale"],
                      mscale_all_dim=y["mscale_all_dim"], beta_fast=y["beta_fast"], beta_slow=y["beta_slow"],
                      original_max_position_embeddings=int(y["original_max_position_embeddings"]))
        return MLATransformerConfig(**kw)
    config = TransformerConfig(**kw)
    if arch.rope_yarn:
        # NOTE: megatron's GPT ``yarn`` embedding and its attention's cos/sin factor read these (not dataclass
        # fields: megatron's own argument parsing sets them the same way)
        y = arch.rope_yarn
        for name, value in (("rotary_scaling_factor", y["factor"]),
                            ("original_max_position_embeddings", int(y["original_max_position_embeddings"])),
                            ("beta_fast", y["beta_fast"]), ("beta_slow", y["beta_slow"]), ("mscale", y["mscale"]),
                            ("mscale_all_dim", y["mscale_all_dim"]),
                            ("correction_range_round_to_int", bool(y.get("truncate", 1.0)))):
            setattr(config, f"yarn_{name}", value)
    return config

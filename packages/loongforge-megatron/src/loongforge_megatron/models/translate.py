"""Translate an :class:`Arch` to and from HF configs, and into megatron-core's TransformerConfig."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from loongforge.errors import RecipeError
from loongforge_megatron.models.arch import Arch
from loongforge_megatron.models.dit import DiTArch, arch_from_diffusers, diffusers_config, is_dit_config

HF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "deepseek_v3": "deepseek_v3",
}
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def _rope_params(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from an HF config dict (transformers 4.x and 5.x spellings)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    return float(theta), scaling


def arch_from_hf(hf_dir: str | Path) -> Arch | DiTArch:
    """Read ``config.json`` of an HF model directory into an :class:`Arch` (a diffusers DiT transformer's into a
    :class:`DiTArch`)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        if (Path(hf_dir) / "model_index.json").is_file() and (Path(hf_dir) / "transformer" / "config.json").is_file():
            raise RecipeError(f"'{hf_dir}' is a diffusers pipeline; give its transformer folder "
                              f"'{Path(hf_dir) / 'transformer'}'", key="model.hf")
        raise RecipeError(f"no config.json in HF model directory '{hf_dir}'", key="model.hf")
    cfg = json.loads(path.read_text())
    if is_dit_config(cfg):
        try:
            return arch_from_diffusers(cfg)
        except ValueError as exc:
            raise RecipeError(f"{path}: {exc}".splitlines()[0], key="model.hf") from None
    if cfg.get("model_type") == "llava":
        return _llava_arch(cfg, path)
    return _arch_from_config(cfg, path)


LLAVA_FIELDS = ("projector_hidden_act", "vision_feature_layer", "vision_feature_select_strategy", "image_token_index",
                "image_seq_length", "multimodal_projector_bias")


def _llava_arch(cfg: dict[str, Any], path: Path) -> Arch:
    """LLaVA: the text config as the language model, the vision config and projector fields as ``Arch.vision``."""
    from loongforge_megatron.conversion.llava import complete_config

    cfg = complete_config(cfg)
    text, vision = dict(cfg.get("text_config") or {}), dict(cfg.get("vision_config") or {})
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise RecipeError(f"{path}: LLaVA with a '{vision.get('model_type')}' vision tower is not supported (CLIP only)",
                          key="model.hf")
    arch = _arch_from_config(text, path)
    if arch.family != "llama":
        raise RecipeError(f"{path}: LLaVA with a '{text['model_type']}' language model is not supported (llama)",
                          key="model.hf")
    extra = {k: cfg[k] for k in LLAVA_FIELDS if k in cfg}  # NOTE: complete_config spells the image token one way
    return arch.model_copy(update={"vision": {"vision_config": vision, **extra}})


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


def _arch_from_config(cfg: dict[str, Any], path: Path) -> Arch:
    model_type = cfg.get("model_type")
    family = HF_MODEL_TYPES.get(model_type)
    if family is None:
        allowed = ", ".join(sorted(HF_MODEL_TYPES))
        raise RecipeError(f"model_type '{model_type}' in {path} is not supported; supported: {allowed}", key="model.hf")
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
    if kind == "yarn" and family == "deepseek_v3":
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
    if model_type == "mistral" or cfg.get("use_sliding_window"):
        # NOTE: Mistral applies a non-null sliding_window; Qwen configs carry one that only use_sliding_window enables
        fields["sliding_window"] = cfg.get("sliding_window")
        if cfg.get("use_sliding_window") and cfg.get("max_window_layers") is not None:
            fields["max_window_layers"] = cfg["max_window_layers"]
    if family == "llama":
        fields["qkv_bias"] = bool(cfg.get("attention_bias", False))
    if family == "qwen2":
        fields["qkv_bias"] = True
    if family in ("qwen3", "qwen3_moe"):
        fields["qk_norm"] = True
        fields["qkv_bias"] = bool(cfg.get("attention_bias", False))
    if family == "qwen3_moe":
        fields.update(num_experts=cfg.get("num_experts", cfg.get("num_local_experts")), moe_topk=cfg["num_experts_per_tok"],
                      moe_ffn_hidden_size=cfg["moe_intermediate_size"], moe_norm_topk=bool(cfg.get("norm_topk_prob", True)))
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise RecipeError("Qwen3-MoE configs with mlp_only_layers / decoder_sparse_step != 1 are not supported", key="model.hf")
    if family == "deepseek_v3":
        fields.pop("head_dim")
        fields.update(
            num_query_groups=heads,
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
    return Arch(**fields)


def hf_config(arch: Arch | DiTArch, *, torch_dtype: str = "float32") -> dict[str, Any]:
    """An HF ``config.json`` dict for ``arch`` (what an HF export writes; diffusers' for a DiT)."""
    if arch.is_dit:
        return diffusers_config(arch)
    if arch.is_vlm:
        return _llava_hf_config(arch, torch_dtype=torch_dtype)
    cfg: dict[str, Any] = dict(
        architectures=[HF_ARCHITECTURES[arch.family]],
        model_type=arch.family,
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
    if arch.family == "llama":
        cfg.update(attention_bias=arch.qkv_bias, mlp_bias=False)
        if arch.sliding_window:  # NOTE: a Mistral (read as llama) goes back as one: Llama would attend past it
            cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=arch.sliding_window)
    if arch.family.startswith("qwen") and arch.sliding_window:
        # NOTE: written back as read (HF's defaults would be use_sliding_window false, or another max_window_layers)
        cfg.update(use_sliding_window=True, sliding_window=arch.sliding_window)
        if arch.max_window_layers is not None:
            cfg["max_window_layers"] = arch.max_window_layers
    if arch.family in ("qwen3", "qwen3_moe"):
        cfg["attention_bias"] = arch.qkv_bias
    if arch.family == "qwen3_moe":
        cfg.update(num_experts=arch.num_experts, num_experts_per_tok=arch.moe_topk, moe_intermediate_size=arch.moe_ffn_hidden_size,
                   norm_topk_prob=arch.moe_norm_topk, decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                   router_aux_loss_coef=arch.moe_aux_loss_coeff)
    if arch.family == "deepseek_v3":
        cfg.pop("head_dim")
        cfg.update(n_routed_experts=arch.num_experts, num_experts_per_tok=arch.moe_topk, moe_intermediate_size=arch.moe_ffn_hidden_size,
                   n_shared_experts=(arch.moe_shared_expert_ffn or 0) // (arch.moe_ffn_hidden_size or 1),
                   first_k_dense_replace=arch.moe_first_dense_layers, norm_topk_prob=arch.moe_norm_topk,
                   routed_scaling_factor=arch.moe_routed_scaling or 1.0, n_group=arch.moe_num_groups or 1,
                   topk_group=arch.moe_group_topk or 1, q_lora_rank=arch.q_lora_rank, kv_lora_rank=arch.kv_lora_rank,
                   qk_nope_head_dim=arch.qk_nope_head_dim, qk_rope_head_dim=arch.qk_rope_head_dim, v_head_dim=arch.v_head_dim,
                   rope_interleave=True, scoring_func="sigmoid", topk_method="noaux_tc")
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


def _llava_hf_config(arch: Arch, *, torch_dtype: str) -> dict[str, Any]:
    """LlavaConfig of a LLaVA arch. The CLIP tower is written with the layers the model runs and
    ``vision_feature_layer = -1`` (the same features as a deeper tower read at -2: megatron's tower holds no more)."""
    from loongforge_megatron.conversion.llava import vision_layers_used

    v = arch.vision
    text = hf_config(arch.model_copy(update={"vision": None}), torch_dtype=torch_dtype)
    text.pop("architectures", None)
    vision = {"model_type": "clip_vision_model", **v["vision_config"],
              "num_hidden_layers": vision_layers_used({"vision_config": v["vision_config"], **v})}
    return {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "text_config": text,
        "vision_config": vision, "image_token_index": v["image_token_index"],
        **({"image_seq_length": v["image_seq_length"]} if v.get("image_seq_length") else {}),
        "projector_hidden_act": v.get("projector_hidden_act", "gelu"),
        "vision_feature_layer": -1, "vision_feature_select_strategy": "default", "multimodal_projector_bias": True,
        "tie_word_embeddings": arch.tie_embeddings, "torch_dtype": torch_dtype,
    }

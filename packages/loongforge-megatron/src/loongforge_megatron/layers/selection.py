"""Which layers a language model is built of: the ``kernels.layers`` set (loongforge / te / local; auto picks),
the kernel provider it asks, the MoE layer options (grouped experts, permute dispatch, fused router) and the
decoder's per-layer specs. Shared by every kind with a GPT-style decoder."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from loongforge.errors import RecipeError

if TYPE_CHECKING:
    from loongforge_megatron.models.gpt.arch import Arch


def te_incompatible(recipe: Any) -> str:
    """What in ``recipe`` needs the local / loongforge layer names or masks ("" when TransformerEngine's spec fits)."""
    c = recipe.checkpoint
    needs = [what for what, on in (("checkpoint.load (HF weights)", bool(c.load)),
                                   ("an HF / PEFT export", bool({"hf", "peft"} & set(c.save_format))),
                                   ("data.format sft (packed sequences)", recipe.data.format == "sft")) if on]
    return ", ".join(needs)


def check_provider(recipe: Any) -> None:
    """An explicit ``kernels.provider`` must be one the layer spec uses and must serve every op of our spec
    (select_op never swaps an explicitly chosen provider for another)."""
    name, spec = recipe.kernels.provider, recipe.kernels.layers
    if name == "auto":
        return
    if spec in ("local", "te"):
        raise RecipeError(f"kernels.provider is used by the loongforge spec; kernels.layers '{spec}' uses none",
                          key="kernels.provider")
    from loongforge import registry
    from loongforge.errors import PluginError

    try:
        ops = registry.kernels.get(name)().ops()
    except PluginError as exc:
        raise RecipeError(str(exc).splitlines()[0], key="kernels.provider") from None
    needed = ("rms_norm", "swiglu", "rope", "fused_linear_cross_entropy")
    missing = [op for op in needed if op not in ops]
    if missing:
        raise RecipeError(f"kernel provider '{name}' has no {', '.join(missing)}; the loongforge spec needs "
                          f"{', '.join(needed)}", key="kernels.provider")


def layer_set(recipe: Any) -> str:
    """auto: TransformerEngine's spec when TE is installed and the recipe neither loads / exports HF weights nor
    packs SFT sequences (:func:`te_incompatible`), else ours (SDPA + fused kernels)."""
    spec = recipe.kernels.layers
    if spec == "te" and importlib.util.find_spec("transformer_engine") is None:
        # NOTE: checked here, not at validate: a recipe for a TE machine still validates on a laptop
        raise RecipeError("kernels.layers te needs TransformerEngine, which is not installed here; use kernels.layers "
                          "loongforge (or auto)", key="kernels.layers")
    if spec != "auto":
        return spec
    if te_incompatible(recipe):
        return "loongforge"
    try:
        import transformer_engine  # noqa: F401

        return "te"
    except ImportError:
        return "loongforge"


def grouped_experts(recipe: Any, arch: Arch, plan: Any, *, accelerator: Any, config: Any, spec_name: str,
                    precision: str) -> bool:
    """``kernels.moe_grouped_gemm``; unset: grouped on the loongforge spec when grouped_mm runs the expert
    shapes in this precision on this device, and the stage is not LoRA (its adapters wrap per-expert linears)."""
    from loongforge_megatron.layers.grouped_experts import grouped_mm_supported

    want = recipe.kernels.moe_grouped_gemm
    if not arch.is_moe or want is False:
        return False
    ffn = (arch.moe_ffn_hidden_size or arch.ffn_hidden_size) // plan.etp
    ok = grouped_mm_supported(device_type=accelerator.device_type, dtype=config.params_dtype,
                              hidden_size=arch.hidden_size, ffn_size=ffn)
    if want is None:
        return ok and spec_name == "loongforge" and recipe.train.stage != "lora"
    if not ok:
        raise RecipeError(f"kernels.moe_grouped_gemm: torch grouped_mm does not run experts of hidden "
                          f"{arch.hidden_size} / ffn {ffn} in {precision} on {accelerator.device_type} (it needs "
                          "bf16 on CUDA sm80+, or the CPU, and rows of a multiple of 16 bytes); set it false",
                          key="kernels.moe_grouped_gemm")
    return True


def permute_dispatch(arch: Arch, plan: Any, *, grouped: bool) -> bool:
    """``model.moe_token_dispatcher`` permute (auto: where it applies): our fused, sync-free dispatch."""
    want = arch.moe_token_dispatcher if arch.is_moe else "alltoall"
    if want not in ("auto", "permute"):
        return False
    why = ("ep > 1" if plan.ep > 1 else f"expert tp {plan.etp}" if plan.etp > 1 else
           "experts padded to capacity (moe_pad_to_capacity)" if arch.moe_pad_to_capacity else
           "moe_shared_expert_overlap (it overlaps the shared experts with megatron's all-to-all)"
           if arch.moe_shared_expert_overlap else
           "SequentialMLP experts (it folds the probabilities into the combine; kernels.moe_grouped_gemm)"
           if not grouped else None)
    if want == "permute" and why:
        raise RecipeError(f"model.moe_token_dispatcher permute runs every expert on one rank, unpadded, with grouped "
                          f"experts; this run has {why}: use alltoall", key="model.moe_token_dispatcher")
    return why is None


def moe_kernels(recipe: Any, arch: Arch, plan: Any, *, accelerator: Any, config: Any, spec_name: str,
                precision: str) -> dict[str, bool]:
    """The MoE layer options of ``spec_name``: grouped-GEMM experts (loongforge / local), and on the loongforge
    spec the permute dispatcher and the fused router."""
    if spec_name not in ("loongforge", "local"):
        if arch.is_moe and arch.moe_token_dispatcher == "permute":
            raise RecipeError(f"model.moe_token_dispatcher permute is part of the loongforge spec, not "
                              f"kernels.layers {spec_name}", key="model.moe_token_dispatcher")
        return {}
    grouped = grouped_experts(recipe, arch, plan, accelerator=accelerator, config=config, spec_name=spec_name,
                              precision=precision)
    if spec_name == "local":
        if arch.is_moe and arch.moe_token_dispatcher == "permute":
            raise RecipeError("model.moe_token_dispatcher permute is part of the loongforge spec, not "
                              "kernels.layers local", key="model.moe_token_dispatcher")
        return {"moe_grouped_gemm": grouped}
    out = {"moe_grouped_gemm": grouped, "moe_permute_dispatch": permute_dispatch(arch, plan, grouped=grouped),
           "moe_router_fusion": arch.is_moe and recipe.kernels.moe_router_fusion}
    moe = recipe.model.moe
    if arch.is_moe and (moe.replica_slots_per_rank or moe.overlap_a2a):
        if moe.replica_slots_per_rank and not grouped:
            raise RecipeError("model.moe.replica_slots_per_rank runs on grouped experts; kernels.moe_grouped_gemm "
                              "is off here (set it true, or remove the replicas)", key="model.moe.replica_slots_per_rank")
        out.update(moe_replica_slots=moe.replica_slots_per_rank, moe_overlap_a2a=moe.overlap_a2a)
    return out


def check_moe_runtime(recipe: Any, arch: Arch, plan: Any) -> None:
    """``model.moe``: expert replicas and the overlapped all-to-all where this run can use them (one line each)."""
    moe = recipe.model.moe
    k = moe.replica_slots_per_rank
    if not (k or moe.overlap_a2a):
        return
    key = "model.moe.replica_slots_per_rank" if k else "model.moe.overlap_a2a"
    what = "expert replicas" if k else "the overlapped all-to-all"
    why = ("this model has no experts" if not arch.is_moe else
           f"they run under expert parallelism; parallel.ep is {plan.ep} (set ep > 1)" if plan.ep <= 1 else
           f"expert tensor parallelism (etp {plan.etp}) is not supported with them" if plan.etp > 1 else
           f"kernels.layers {recipe.kernels.layers} does not have them (use loongforge)"
           if recipe.kernels.layers in ("te", "local") else
           f"model.moe_token_dispatcher {arch.moe_token_dispatcher}: they run on alltoall"
           if getattr(arch, "moe_token_dispatcher", "auto") not in ("auto", "alltoall") else
           "token dropping (moe_capacity_factor) is not supported with them"
           if getattr(arch, "moe_capacity_factor", None) else None)
    if why is None and moe.overlap_a2a and getattr(arch, "moe_shared_expert_overlap", False):
        key, why = "model.moe.overlap_a2a", "moe_shared_expert_overlap already overlaps the all-to-all; use one of them"
    if why:
        raise RecipeError(f"{what}: {why}", key=key)
    home = arch.num_experts // plan.ep
    if k > arch.num_experts - home:
        raise RecipeError(f"{k} replica slots per rank for {arch.num_experts} experts on ep {plan.ep}: allowed 1 .. "
                          f"{arch.num_experts - home} (a rank holds at most every expert once)", key=key)


def decoder_layers(config: Any, arch: Arch, *, spec_name: str, provider: str, accelerator: Any,
                   moe: Mapping[str, bool] | None = None):
    """The decoder layer spec (or per-chunk block spec builder) of ``spec_name`` for ``arch``; ``moe``: the MoE
    layer options (:func:`moe_kernels`)."""
    from loongforge_megatron import engine

    kw = dict(num_experts=arch.num_experts, qk_layernorm=arch.qk_norm, multi_latent_attention=arch.is_mla,
              **(moe or {}))
    if spec_name == "local":
        grouped = kw.pop("moe_grouped_gemm", False)
        spec = engine.layer_spec(spec_name, **kw)
        if grouped and arch.num_experts:
            from loongforge_megatron.layers.grouped_experts import with_grouped_experts

            spec = with_grouped_experts(spec)
        return spec
    if spec_name != "loongforge":
        return engine.layer_spec(spec_name, **kw)
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from loongforge_megatron.layers import KernelRMSNorm, loongforge_layer_spec, prepare_config

    prepare_config(config)
    moe = loongforge_layer_spec(provider=provider, accelerator=accelerator, **kw)
    # NOTE: multi-token prediction's MoE layer keeps the plain layer (the replica plan covers the decoder's layers)
    mtp_moe = (loongforge_layer_spec(provider=provider, accelerator=accelerator,
                                     **{**kw, "moe_replica_slots": 0, "moe_overlap_a2a": False})
               if kw.get("moe_replica_slots") or kw.get("moe_overlap_a2a") else moe)
    dense = loongforge_layer_spec(provider=provider, accelerator=accelerator,
                                  **{**kw, "num_experts": None}) if arch.is_moe else moe
    freq = config.moe_layer_freq if arch.is_moe else None
    final_norm = ModuleSpec(module=KernelRMSNorm, params={"provider": provider, "accelerator": accelerator})

    def block(vp_stage: int | None):
        # NOTE: a full block spec so the final norm is ours too (megatron's default final norm refuses SP),
        # with dense layers where moe_layer_freq says so (DeepSeek's first_k_dense_replace).
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        n = get_num_layers_to_build(config, vp_stage=vp_stage)
        layers = [moe if not isinstance(freq, list) or freq[offset + i] else dense for i in range(n)]
        return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm)

    block.mtp_layer = mtp_moe  # NOTE: the layer of multi-token prediction (engine/mtp.py): the decoder's MoE layer
    return block

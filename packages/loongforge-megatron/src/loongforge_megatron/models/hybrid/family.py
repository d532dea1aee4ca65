"""The hybrid LM kind: gated DeltaNet and gated full attention layers (``layer_types``) on megatron's ``GPTModel``.
A family (``qwen3_next.py``, ``qwen3_5.py``) sets its HF layout; sizes, checks and building are the kind's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongforge.errors import RecipeError

from loongforge_megatron.models.gpt.family import GPTFamily
from loongforge_megatron.models.gpt.translate import transformer_config
from loongforge_megatron.models.hybrid import names
from loongforge_megatron.models.hybrid.arch import HybridArch
from loongforge_megatron.models.hybrid.config import HybridModelConfig
from loongforge_megatron.models.spec import Data, HFConfig, Model, Supports

# NOTE: train.lora.targets qkv / proj take the gated DeltaNet's input / output projections too (their PEFT names
# are HF's: in_proj_qkv / in_proj_z / in_proj_b / in_proj_a or in_proj_qkvz / in_proj_ba, out_proj)
LORA_TARGETS = {"qkv": ("linear_qkv", "in_proj_qkvz", "in_proj_ba"), "proj": ("linear_proj", "out_proj"),
                "fc1": ("linear_fc1",), "fc2": ("linear_fc2",)}


def _partial_rotary(cfg: HFConfig) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)


class HybridFamily(GPTFamily):
    """A gated-DeltaNet hybrid LM. ``split_projections``: the HF DeltaNet layout (see ``names.py``)."""

    kind = "a hybrid (gated DeltaNet + attention) language model"
    arch_type = HybridArch
    model_section = HybridModelConfig
    split_projections = False
    supports = Supports(parallel=("tp", "sp", "cp", "pp", "vpp", "ep", "etp"), layers=("auto", "loongforge", "local"))

    def arch(self, fields: Any) -> HybridArch:
        return HybridArch(**{"family": self.name, **fields})

    def read_hf(self, cfg: HFConfig, fields: dict[str, Any], *, path: Path) -> dict[str, Any]:
        if cfg.get("attention_bias"):
            raise RecipeError(f"{path}: attention_bias true is not supported for {self.name}", key="model.hf")
        fields.update(qk_norm=True, rotary_percent=_partial_rotary(cfg), layer_types=names.layer_types(cfg),
                      linear_num_key_heads=cfg["linear_num_key_heads"],
                      linear_num_value_heads=cfg["linear_num_value_heads"],
                      linear_key_head_dim=cfg["linear_key_head_dim"],
                      linear_value_head_dim=cfg["linear_value_head_dim"],
                      linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4))
        if cfg.get("num_experts"):
            if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
                raise RecipeError(f"{path}: mlp_only_layers / decoder_sparse_step != 1 (dense layers among MoE "
                                  "layers) are not supported", key="model.hf")
            fields.update(num_experts=cfg["num_experts"], moe_topk=cfg["num_experts_per_tok"],
                          moe_ffn_hidden_size=cfg["moe_intermediate_size"],
                          moe_shared_expert_ffn=cfg["shared_expert_intermediate_size"],
                          moe_norm_topk=bool(cfg.get("norm_topk_prob", True)))
        return fields

    def arch_from_hf(self, cfg: HFConfig, *, path: Path) -> HybridArch:
        cfg = dict(cfg)
        cfg.setdefault("intermediate_size", cfg.get("moe_intermediate_size") or cfg["hidden_size"])
        return super().arch_from_hf(cfg, path=path)

    def write_hf(self, arch: HybridArch, cfg: HFConfig) -> HFConfig:
        cfg.pop("rope_theta", None)
        cfg.update(attention_bias=False, layer_types=arch.layers, linear_num_key_heads=arch.linear_num_key_heads,
                   linear_num_value_heads=arch.linear_num_value_heads, linear_key_head_dim=arch.linear_key_head_dim,
                   linear_value_head_dim=arch.linear_value_head_dim,
                   linear_conv_kernel_dim=arch.linear_conv_kernel_dim,
                   rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta,
                                    "partial_rotary_factor": arch.rotary_percent})
        if arch.mtp_num_layers:
            cfg["mtp_num_hidden_layers"] = arch.mtp_num_layers  # NOTE: the published configs' key
        if arch.is_moe:
            cfg.update(num_experts=arch.num_experts, num_experts_per_tok=arch.moe_topk,
                       moe_intermediate_size=arch.moe_ffn_hidden_size,
                       shared_expert_intermediate_size=arch.moe_shared_expert_ffn, norm_topk_prob=arch.moe_norm_topk,
                       decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                       router_aux_loss_coef=arch.moe_aux_loss_coeff)
        return cfg

    def num_experts(self, cfg: HFConfig) -> int:
        return cfg.get("num_experts") or 0

    # NOTE: the published checkpoints carry a multi-token-prediction layer (mtp.*), which transformers ignores;
    # it loads into megatron's MTP block with model.mtp_num_layers 1, and a conversion keeps it
    mtp = True

    def ignore_hf(self, cfg: HFConfig, name: str) -> bool:
        return super().ignore_hf(cfg, name) or name.startswith(names.MTP)

    def mtp_layers_in(self, cfg: HFConfig, names_: list[str]) -> int:
        return names.mtp_layers_in(names_)

    def name_map(self, cfg: HFConfig, *, divisible_by: int = 128):
        return names.name_map(cfg, divisible_by=divisible_by, split=self.split_projections)

    def check_family(self, recipe: Any, plan: Any, arch: HybridArch) -> None:
        if arch.mtp_num_layers > 1:
            raise RecipeError(f"model.mtp_num_layers {arch.mtp_num_layers}: {self.name}'s HF layout holds one "
                              "multi-token-prediction layer (mtp.layers.0 with one mtp.fc); set 1 or 0",
                              key="model.mtp_num_layers")
        if arch.is_moe and not arch.moe_shared_expert_ffn:
            raise RecipeError(f"{self.name} MoE layers have a gated shared expert: set model.moe_shared_expert_ffn",
                              key="model.moe_shared_expert_ffn")
        for what, n in (("linear_num_key_heads", arch.linear_num_key_heads), ("num_query_groups", arch.kv_heads)):
            if n % plan.tp:
                raise RecipeError(f"model.{what} {n} does not split over parallel.tp {plan.tp}", key=f"model.{what}")

    def layer_spec(self, *, recipe: Any, arch: HybridArch, plan: Any, accelerator: Any, config: Any,
                   precision: str) -> Any:
        """The per-chunk block spec builder of ``arch``'s layers (a VLM on this language model builds it too); sets
        the config's gated attention output (and MoE shared-expert gate)."""
        from loongforge_megatron.layers.selection import grouped_experts
        from loongforge_megatron.models.hybrid.layers import block_spec

        config.attention_output_gate = True
        if arch.is_moe:
            config.moe_shared_expert_gate = True
        grouped = grouped_experts(recipe, arch, plan, accelerator=accelerator, config=config, spec_name="local",
                                  precision=precision)
        return block_spec(config, layer_types=arch.layers, shape=arch.linear_shape,
                          num_experts=arch.num_experts, grouped_experts=grouped)

    def model(self, *, recipe: Any, arch: HybridArch, plan: Any, accelerator: Any, device: Any, precision: str,
              data: Data) -> Model:
        from loongforge_megatron.engine.model import build_chunks
        from loongforge_megatron.engine.weights import seeded_init
        from loongforge_megatron.layers.output import mask_padded_vocab
        from loongforge_megatron.models.lm import padded_vocab

        config = transformer_config(arch, plan=plan, precision=precision,
                                    cpu_init=accelerator.device_type == "cpu" or recipe.model.init_on_cpu,
                                    grad_accum_fusion=recipe.kernels.grad_accum_fusion)
        spec = self.layer_spec(recipe=recipe, arch=arch, plan=plan, accelerator=accelerator, config=config,
                               precision=precision)
        mtp = None
        if arch.mtp_num_layers:
            from loongforge_megatron.engine.mtp import mtp_block_spec

            mtp = mtp_block_spec(spec.mtp_layer, depths=arch.mtp_num_layers)
        chunks = build_chunks(
            transformer_config=config, layer_spec=spec, mtp_block_spec=mtp,
            vocab_size=padded_vocab(arch.vocab_size, plan.tp),
            max_sequence_length=max(arch.max_position_embeddings, recipe.data.seq_length),
            rotary_base=arch.rope_theta, rotary_percent=arch.rotary_percent,
            share_embeddings_and_output_weights=arch.tie_embeddings, vpp=plan.vpp, device=device)
        seeded_init(chunks, config=config, seed=recipe.train.seed)
        mask_padded_vocab(chunks, vocab_size=arch.vocab_size)
        return Model(chunks=chunks, config=config, kernels="local", lora_targets=LORA_TARGETS)

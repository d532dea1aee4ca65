"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``; V3.2-Exp's checkpoints): DeepSeek-V3 with DeepSeek Sparse Attention.
Every MLA layer has a lightning indexer (``self_attn.indexer.*``) that picks each query's ``index_topk`` keys
(``layers/sparse_attention.py``). Training: a dense warm-up of ``model.dsa.warmup_steps`` steps in which only the
indexer learns, then sparse training."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

from loongforge.checkpoint import Entry, NameMap, Replicated
from loongforge.errors import RecipeError
from loongforge.recipe.schema import Section
from pydantic import Field

from loongforge_megatron.config import ModelConfig
from loongforge_megatron.models.gpt.arch import Arch
from loongforge_megatron.models.gpt.deepseek_v3 import PRESETS as V3_PRESETS
from loongforge_megatron.models.gpt.deepseek_v3 import DeepseekV3, mla_attention, mlp, with_mtp
from loongforge_megatron.models.gpt.names import H, HFConfig, L, ends, norms
from loongforge_megatron.models.spec import Model

_V3 = {k: v for k, v in V3_PRESETS["deepseek-v3"].items() if k != "family"}
_TINY = {k: v for k, v in V3_PRESETS["deepseek-v3-tiny"].items() if k != "family"}

PRESETS: dict[str, dict[str, Any]] = {
    # deepseek-ai/DeepSeek-V3.2-Exp's config.json: DeepSeek-V3's shape plus a 64-head, 128-dim indexer, top-2048
    "deepseek-v3.2": dict(_V3, family="deepseek_v32", dsa_index_heads=64, dsa_index_head_dim=128, dsa_index_topk=2048),
    # a reduced shape (12 layers, hidden 2048, 64 experts) for one-node benchmarks of the sparse path
    "deepseek-v3.2-lite": dict(_V3, family="deepseek_v32", num_layers=12, hidden_size=2048, ffn_hidden_size=10944,
                               num_attention_heads=16, num_experts=64, moe_topk=6, moe_ffn_hidden_size=1408,
                               moe_shared_expert_ffn=2816, moe_first_dense_layers=1, moe_num_groups=1,
                               moe_group_topk=1, q_lora_rank=1536, dsa_index_heads=32, dsa_index_head_dim=128,
                               dsa_index_topk=2048),
    "deepseek-v3.2-tiny": dict(_TINY, family="deepseek_v32", dsa_index_heads=8, dsa_index_head_dim=16,
                               dsa_index_topk=16),
}


class DSASettings(Section):
    """``model.dsa``: how DeepSeek Sparse Attention trains."""

    topk: int | None = Field(None, ge=1, description="keys each query attends to (default: the architecture's "
                             "index_topk)")
    loss_weight: float = Field(0.01, ge=0, description="weight of the indexer's KL loss (its inputs are detached: "
                               "it trains the indexer only); 0: the indexer does not learn")
    warmup_steps: int = Field(0, ge=0, description="dense warm-up steps: full attention, only the indexer learns "
                              "(the rest of the model gets zero gradients); sparse attention from this step on")


class DeepseekV32ModelConfig(ModelConfig):
    """``model`` of DeepSeek-V3.2: the shared keys plus ``dsa``."""

    not_arch: ClassVar[tuple[str, ...]] = ("dsa",)

    dsa: DSASettings = Field(default_factory=DSASettings)


def indexer(h: HFConfig, *, shared: frozenset[int] = frozenset()) -> list[Entry]:
    """The lightning indexer's tensors: replicated on every TP rank (each rank scores the whole sequence); none in
    the ``shared`` layers (which reuse an earlier layer's top-k)."""
    m, hf = L + "self_attention.core_attention.indexer.", H + "self_attn.indexer."

    def has(i: int) -> bool:
        return i not in shared

    def heads(c):
        return c["index_n_heads"]

    def dim(c):
        return c["index_head_dim"]

    return [
        Entry(m + "linear_wq_b.weight", hf + "wq_b.weight", Replicated(), layers=has,
              shape=lambda c: (heads(c) * dim(c), c["q_lora_rank"])),
        Entry(m + "linear_wk.weight", hf + "wk.weight", Replicated(), layers=has,
              shape=lambda c: (dim(c), c["hidden_size"])),
        Entry(m + "k_norm.weight", hf + "k_norm.weight", Replicated(), layers=has, shape=lambda c: (dim(c),)),
        Entry(m + "k_norm.bias", hf + "k_norm.bias", Replicated(), layers=has, shape=lambda c: (dim(c),)),
        Entry(m + "linear_weights_proj.weight", hf + "weights_proj.weight", Replicated(), layers=has,
              shape=lambda c: (heads(c), c["hidden_size"])),
    ]


def _sparse_block(spec: Any, arch: Arch) -> Any:
    """Every decoder layer of ``spec`` (a layer ModuleSpec or the loongforge spec's per-chunk block builder, with
    its MTP layer) with sparse MLA core attention."""
    from loongforge_megatron.layers.sparse_attention import sparse_layer_spec

    def layer(s: Any) -> Any:
        return sparse_layer_spec(s, index_heads=arch.dsa_index_heads, index_head_dim=arch.dsa_index_head_dim,
                                 rope_interleaved=arch.dsa_index_rope_interleaved,
                                 shared_layers=frozenset(arch.dsa_index_shared_layers or ()))

    if not callable(spec) or hasattr(spec, "submodules"):
        return layer(spec)

    def block(vp_stage: int | None):
        built = spec(vp_stage)
        return dataclasses.replace(built, layer_specs=[layer(s) for s in built.layer_specs])

    if hasattr(spec, "mtp_layer"):
        block.mtp_layer = layer(spec.mtp_layer)
    return block


def _warmup_step(inner: Any, phase: Any):
    """The forward step of the dense warm-up: the LM loss is reported but back-propagates zeros, so only the
    indexer's own loss (attached to each attention output) moves a weight."""
    def step(data_iterator, model):
        output, loss_func = inner(data_iterator, model)
        if phase.sparse:
            return output, loss_func

        def frozen(*args, **kwargs):
            loss, n, report = loss_func(*args, **kwargs)
            return loss * 0.0, n, report

        return output, frozen

    return step


class DeepseekV32(DeepseekV3):
    """``DeepseekV32ForCausalLM``: DeepSeek-V3's map plus each layer's indexer; trained with sparse attention."""

    name = "deepseek_v32"
    model_types = ("deepseek_v32",)
    trained_types = ("deepseek_v32",)
    presets = PRESETS
    hf_architecture = "DeepseekV32ForCausalLM"
    model_section = DeepseekV32ModelConfig

    def read_hf(self, cfg: dict, fields: dict[str, Any], *, path: Path) -> dict[str, Any]:
        fields = super().read_hf(cfg, fields, path=path)
        fields.update(dsa_index_heads=cfg.get("index_n_heads", 64), dsa_index_head_dim=cfg.get("index_head_dim", 128),
                      dsa_index_topk=cfg.get("index_topk", 2048))
        return fields

    def write_hf(self, arch: Arch, cfg: dict) -> dict:
        cfg = super().write_hf(arch, cfg)
        for key in ("rope_interleave", "scoring_func", "topk_method"):  # NOTE: not fields of DeepseekV32Config
            cfg.pop(key, None)
        cfg.update(index_n_heads=arch.dsa_index_heads, index_head_dim=arch.dsa_index_head_dim,
                   index_topk=arch.dsa_index_topk)
        return cfg

    def shared_layers(self, cfg: HFConfig) -> frozenset[int]:
        """Layers without an indexer in an HF config (none for DeepSeek-V3.2)."""
        return frozenset()

    def name_map(self, cfg: HFConfig, *, divisible_by: int = 128) -> NameMap:
        first, last = ends(cfg, divisible_by=divisible_by)
        attention = mla_attention(cfg) + indexer(cfg, shared=self.shared_layers(cfg))
        return NameMap(with_mtp(cfg, first, norms() + attention + mlp(cfg), last))

    def check_family(self, recipe: Any, plan: Any, arch: Arch) -> None:
        super().check_family(recipe, plan, arch)
        if not arch.dsa_index_heads:
            raise RecipeError("deepseek_v32 needs its lightning indexer's sizes (dsa_index_heads, dsa_index_head_dim, "
                              "dsa_index_topk): use a deepseek-v3.2 preset or its HF config", key="model.family")
        refused = [(key, what) for key, what, on in (
            ("data.format", "packed sequences (data.format sft)", recipe.data.format == "sft"),
            ("kernels.layers", "kernels.layers te (TransformerEngine's attention)", recipe.kernels.layers == "te"),
        ) if on]
        if refused:
            key, what = refused[0]
            raise RecipeError(f"DeepSeek sparse attention does not run with {what} here; use pretrain data and "
                              "kernels.layers loongforge or local", key=key)

    def layers(self, spec: Any, *, arch: Arch) -> Any:
        return _sparse_block(spec, arch)

    def finish(self, model: Model, *, recipe: Any, arch: Arch, accelerator: Any) -> Model:
        from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

        from loongforge_megatron.engine.step import forward_step
        from loongforge_megatron.layers.sparse_attention import DSAPhase, phase_of

        dsa = recipe.model.dsa
        phase = DSAPhase(topk=dsa.topk or arch.dsa_index_topk, loss_weight=dsa.loss_weight,
                         warmup_steps=dsa.warmup_steps, provider=recipe.kernels.provider, accelerator=accelerator)
        phase_of(model.chunks, phase)
        # NOTE: megatron's schedules give the indexer loss the main loss's scale through this hook
        model.config.experimental_attention_variant_loss_scale_func = DSAIndexerLossAutoScaler.set_loss_scale
        config, bias_rate = model.config, getattr(model.config, "moe_router_bias_update_rate", 0.0)

        def before_step(step: int, optimizer: Any) -> None:
            phase.at_step(step)
            if phase.sparse:
                config.moe_router_bias_update_rate = bias_rate
                return
            # NOTE: the warm-up keeps the rest of the model as it is: zero gradients (the forward step), no weight
            # decay (the scheduler sets it again after each step) and no expert-bias updates (aux-loss-free
            # balancing would move the routing)
            config.moe_router_bias_update_rate = 0.0
            for group in optimizer.param_groups:
                group["weight_decay"] = 0.0

        def step_metrics() -> dict[str, float]:
            return {"dsa_sparse": float(phase.sparse), "dsa_indexer_loss": phase.loss_per_token()}

        model.forward_step = _warmup_step(model.forward_step or forward_step, phase)
        model.before_step, model.step_metrics = before_step, step_metrics
        return model


SPEC = DeepseekV32()

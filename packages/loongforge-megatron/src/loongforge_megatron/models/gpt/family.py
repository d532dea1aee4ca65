"""The GPT model kind: decoder-only LMs on megatron's ``GPTModel``. A family (``llama.py``, ``qwen3.py`` ...)
subclasses :class:`GPTFamily` with its presets, its own HF config fields both ways and its name map; building,
data, the forward step and the recipe checks are the kind's."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loongforge.errors import RecipeError

from loongforge_megatron.models.base import HFCheckpoint, copy_assets
from loongforge_megatron.models.gpt import names
from loongforge_megatron.models.gpt.arch import Arch
from loongforge_megatron.models.gpt.translate import arch_fields, hf_fields, transformer_config
from loongforge_megatron.models.spec import Data, HFConfig, Model

if TYPE_CHECKING:
    from loongforge.checkpoint import NameMap

# Vocabulary padding for TP: pad only to a multiple of tp, so logits over the real vocabulary equal an
# unpadded model's (padded rows would otherwise join the softmax).
VOCAB_DIVISIBLE_BY = 1


def padded_vocab(vocab_size: int, tp: int) -> int:
    from loongforge.checkpoint import padded_vocab_size

    return padded_vocab_size(vocab_size, divisible_by=VOCAB_DIVISIBLE_BY, tp_size=tp)


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
    name, spec = recipe.kernels.provider, recipe.kernels.spec
    if name == "auto":
        return
    if spec in ("local", "te"):
        raise RecipeError(f"kernels.provider is used by the loongforge spec; kernels.spec '{spec}' uses none",
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


def one_layout(recipe: Any) -> None:
    """Models without separately laid-out components refuse ``parallel.components``."""
    if recipe.parallel.components:
        raise RecipeError("parallel.components sets per-component layouts of VLMs; this model has one layout",
                          key="parallel.components")


def no_compile(recipe: Any) -> None:
    """``train.compile`` compiles DiT layers; LMs get their fused kernels from ``kernels.spec``."""
    if recipe.train.compile:
        raise RecipeError("train.compile (torch.compile of each transformer layer) is for DiT models on this "
                          "backend; LLMs and VLMs get fused kernels from kernels.spec loongforge",
                          key="train.compile")


def no_dit_keys(recipe: Any) -> None:
    dit_only = "model.vae" if recipe.model.vae else "data.format" if recipe.data.format == "latents" else None
    if dit_only:
        raise RecipeError(f"{dit_only} is for DiT models (e.g. model.preset dit-tiny or model.hf of a diffusers "
                          "DiTTransformer2DModel)", key=dit_only)


def no_image_size(recipe: Any, model: str) -> None:
    """``data.image_size`` sizes the images of a Qwen-VL model's synthetic samples and a DiT's latents only."""
    if recipe.data.image_size is not None:
        raise RecipeError(f"data.image_size sets the image side of a Qwen-VL model's synthetic samples or a DiT's "
                          f"latents; {model}: remove it", key="data.image_size")


def check_lm(recipe: Any, plan: Any, arch: Arch) -> None:
    """What every language model (a VLM's too) must satisfy: MoE / LoRA / etp / te / FP8-policy limits, positions."""
    if arch.is_moe and plan.tp > 1 and not plan.sp:
        raise RecipeError(f"MoE layers under tensor parallelism (tp {plan.tp}) need sequence parallelism (megatron "
                          "refuses at the first forward): set parallel.sp true", key="parallel.sp")
    lora = recipe.train.lora if recipe.train.stage == "lora" else None
    if lora is not None and arch.is_moe and plan.ep > 1 and {"fc1", "fc2"} & set(lora.targets):
        # NOTE: the adapters' gradients would be averaged over the dense data-parallel group, which spans expert
        # ranks holding different experts: one adapter shared by different experts
        raise RecipeError(f"LoRA on MoE expert MLPs (fc1 / fc2) under expert parallelism (ep {plan.ep}) is not "
                          "supported; use train.lora.targets [qkv, proj], or ep 1", key="train.lora.targets")
    if recipe.kernels.moe_grouped_gemm and arch.is_moe:
        if lora is not None and {"fc1", "fc2"} & set(lora.targets):
            raise RecipeError("kernels.moe_grouped_gemm true cannot take LoRA adapters on the expert MLPs "
                              "(fc1 / fc2 are wrapped per expert); leave it unset or false for LoRA",
                              key="kernels.moe_grouped_gemm")
        if recipe.kernels.spec == "te":
            raise RecipeError("kernels.moe_grouped_gemm selects our grouped_mm experts of the loongforge / local "
                              "spec; kernels.spec te uses TransformerEngine's own experts", key="kernels.moe_grouped_gemm")
    if arch.is_moe and arch.moe_token_dispatcher == "permute":
        why = ("ep > 1" if plan.ep > 1 else f"expert tp {plan.etp}" if plan.etp > 1 else
               "moe_pad_to_capacity" if arch.moe_pad_to_capacity else
               "kernels.moe_grouped_gemm false" if recipe.kernels.moe_grouped_gemm is False else
               f"kernels.spec {recipe.kernels.spec}" if recipe.kernels.spec in ("te", "local") else None)
        if why:
            raise RecipeError(f"model.moe_token_dispatcher permute runs every expert on one rank, unpadded, with "
                              f"grouped experts of the loongforge spec; this recipe has {why}: use alltoall",
                              key="model.moe_token_dispatcher")
    hf_weights = [what for what, on in (("an HF export (checkpoint.save_format hf)", "hf" in recipe.checkpoint.save_format),
                                   ("HF weights (checkpoint.load)", bool(recipe.checkpoint.load))) if on]
    if arch.is_moe and plan.etp not in (1, plan.tp) and hf_weights:
        # NOTE: the HF mappings shard a routed expert over all TP ranks or none (etp = tp or 1)
        raise RecipeError(f"parallel.etp {plan.etp} with tp {plan.tp} has no HF layout for {' or '.join(hf_weights)}: "
                          "use etp 1 or etp = tp", key="parallel.etp")
    if recipe.train.fp8 is not None and recipe.train.fp8.policy:
        from loongforge_megatron.layers.fp8 import load_policy

        load_policy(recipe.train.fp8.policy)  # a missing or foreign file names train.fp8.policy
    te_needs = te_incompatible(recipe)
    if recipe.kernels.spec == "te" and te_needs:
        raise RecipeError(f"kernels.spec te cannot be used with {te_needs}: TransformerEngine's layers fold the norms "
                          "into the linears (other parameter names than the HF mappings know) and its causal "
                          "attention ignores packed-sequence masks; use kernels.spec loongforge", key="kernels.spec")
    if arch.mtp_num_layers and recipe.kernels.spec == "te":
        raise RecipeError("model.mtp_num_layers (multi-token prediction) is built on the loongforge / local spec; "
                          "kernels.spec te would need TransformerEngine's MTP modules", key="model.mtp_num_layers")
    if arch.mtp_num_layers and recipe.data.format == "sft":
        # NOTE: megatron's MTP shifts tokens within packed sequences only with packed_seq_params, which the
        # local attention here replaces by a block mask
        raise RecipeError("model.mtp_num_layers (multi-token prediction) with data.format sft (packed sequences) is "
                          "not supported: the shifted tokens would cross document boundaries; use pretrain data",
                          key="model.mtp_num_layers")
    if recipe.data.seq_length > arch.max_position_embeddings:
        raise RecipeError(f"seq_length {recipe.data.seq_length} exceeds the model's max_position_embeddings "
                          f"{arch.max_position_embeddings}", key="data.seq_length")
    if arch.sliding_window and recipe.data.seq_length > arch.sliding_window:
        # NOTE: the HF model attends only to the last sliding_window tokens; megatron here to all of them
        raise RecipeError(f"the HF config's sliding-window attention (sliding_window {arch.sliding_window}) is "
                          f"not applied by this backend (megatron attends over the whole sequence): seq_length "
                          f"{recipe.data.seq_length} would train attention the model does not have; set "
                          f"data.seq_length <= {arch.sliding_window}", key="data.seq_length")


def tokenizer_for(recipe: Any, runtime: Any) -> Any:
    """The run's tokenizer (preparing ``data.path`` on the main rank first); None for synthetic data."""
    import torch.distributed as dist

    from loongforge_megatron.data.prepare import is_prepared, prepare, tokenizer_dir
    from loongforge_megatron.data.tokenizer import load_tokenizer

    data = recipe.data
    if data.format == "synthetic":
        return None
    if data.format != "llava" and data.path and not is_prepared(data.path):  # llava: a records file as is
        if runtime.is_main:
            prepare(recipe)
        dist.barrier()
    path = tokenizer_dir(recipe)
    if path is None:
        raise RecipeError("no tokenizer found: set data.tokenizer or model.hf", key="data.tokenizer")
    return load_tokenizer(path)


def tokenizer_assets(recipe: Any):
    """An export's tokenizer files: copied from the run's tokenizer directory (None when there is none)."""
    from loongforge_megatron.data.prepare import tokenizer_dir

    tok_dir = tokenizer_dir(recipe)
    if tok_dir is None:
        return None

    def put(staging: Path) -> None:
        copy_assets(Path(tok_dir), staging)

    return put


def kernel_spec(recipe: Any) -> str:
    """auto: TransformerEngine's spec when TE is installed and the recipe neither loads / exports HF weights nor
    packs SFT sequences (:func:`te_incompatible`), else ours (SDPA + fused kernels)."""
    spec = recipe.kernels.spec
    if spec == "te" and importlib.util.find_spec("transformer_engine") is None:
        # NOTE: checked here, not at validate: a recipe for a TE machine still validates on a laptop
        raise RecipeError("kernels.spec te needs TransformerEngine, which is not installed here; use kernels.spec "
                          "loongforge (or auto)", key="kernels.spec")
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
                              f"kernels.spec {spec_name}", key="model.moe_token_dispatcher")
        return {}
    grouped = grouped_experts(recipe, arch, plan, accelerator=accelerator, config=config, spec_name=spec_name,
                              precision=precision)
    if spec_name == "local":
        if arch.is_moe and arch.moe_token_dispatcher == "permute":
            raise RecipeError("model.moe_token_dispatcher permute is part of the loongforge spec, not "
                              "kernels.spec local", key="model.moe_token_dispatcher")
        return {"moe_grouped_gemm": grouped}
    return {"moe_grouped_gemm": grouped, "moe_permute_dispatch": permute_dispatch(arch, plan, grouped=grouped),
            "moe_router_fusion": arch.is_moe and recipe.kernels.moe_router_fusion}


def layer_spec(config: Any, arch: Arch, *, spec_name: str, provider: str, accelerator: Any,
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

    block.mtp_layer = moe  # NOTE: the layer of multi-token prediction (engine/mtp.py): the decoder's MoE layer
    return block


def _mtp_families() -> list[Any]:
    from loongforge_megatron.models import registry

    return [s for s in registry.all_specs().values() if getattr(s, "mtp", False)]


class GPTFamily(HFCheckpoint):
    """A decoder-only LM family. Subclasses set the class attributes and override the ``read_hf`` /
    ``write_hf`` / ``name_map`` / ``check_family`` hooks where the family differs from Llama."""

    name = "llama"
    model_types: tuple[str, ...] = ()
    presets: Mapping[str, Mapping[str, Any]] = {}
    hf_architecture = "LlamaForCausalLM"
    kind = "a language model"
    arch_type = Arch
    mla_yarn = False  # YaRN as megatron's MLA takes it (HF DeepSeek's), not as its GPT yarn embedding
    mtp = False  # has an HF layout for multi-token-prediction layers (DeepSeek-V3's)

    # ---------------------------------------------------------------- architecture
    def arch(self, fields: Mapping[str, Any]) -> Arch:
        return Arch(**{"family": self.name, **fields})

    def arch_from_hf(self, cfg: HFConfig, *, path: Path) -> Arch:
        fields = arch_fields(cfg, path, family=self.name, mla_yarn=self.mla_yarn)
        return self.arch(self.read_hf(cfg, fields, path=path))

    def read_hf(self, cfg: HFConfig, fields: dict[str, Any], *, path: Path) -> dict[str, Any]:
        """The family's own :class:`Arch` fields from its HF config, added to the shared ones."""
        return fields

    def hf_config(self, arch: Arch, *, torch_dtype: str = "float32") -> HFConfig:
        cfg = hf_fields(arch, architecture=self.hf_architecture, model_type=self.model_types[0],
                        torch_dtype=torch_dtype)
        return self.write_hf(arch, cfg)

    def write_hf(self, arch: Arch, cfg: HFConfig) -> HFConfig:
        """The family's own HF config fields for ``arch``, added to the shared ones."""
        return cfg

    def name_map(self, cfg: HFConfig, *, divisible_by: int = 128) -> NameMap:
        return names.decoder(cfg, divisible_by=divisible_by)

    # ---------------------------------------------------------------- recipe checks
    def check(self, recipe: Any, plan: Any, arch: Arch) -> None:
        """Settings megatron or the HF mapping would only refuse mid-run (or get silently wrong)."""
        check_provider(recipe)
        no_compile(recipe)
        one_layout(recipe)
        no_dit_keys(recipe)
        no_image_size(recipe, "a language model's data has no images")
        if recipe.data.format == "conversations":
            raise RecipeError("data.format conversations (image-text messages) needs a Qwen-VL model (e.g. "
                              "model.preset qwen2.5-vl-tiny or model.hf of a Qwen2.5-VL checkpoint)", key="data.format")
        if recipe.data.format == "llava":
            raise RecipeError("data.format llava (image-text conversations) needs a LLaVA model (e.g. model.preset "
                              "llava-tiny or model.hf of a LLaVA checkpoint)", key="data.format")
        if arch.mtp_num_layers and not self.mtp:
            have = sorted(s.name for s in _mtp_families())
            raise RecipeError(f"model.mtp_num_layers: the {self.name} family has no HF layout for multi-token "
                              f"prediction layers (families with one: {', '.join(have)})", key="model.mtp_num_layers")
        fp8 = recipe.train.fp8
        if fp8 is not None and fp8.output_layer and kernel_spec(recipe) == "loongforge":
            # NOTE: the loongforge spec computes the output layer inside its fused linear cross-entropy (bf16
            # GEMMs of its own): an FP8 output layer module would never run
            raise RecipeError("train.fp8.output_layer: the loongforge spec runs the output layer inside its fused "
                              "linear cross-entropy, in bf16; leave it false (or use kernels.spec local / te)",
                              key="train.fp8.output_layer")
        self.check_family(recipe, plan, arch)
        check_lm(recipe, plan, arch)

    def check_family(self, recipe: Any, plan: Any, arch: Arch) -> None:
        """What this family's HF layout cannot hold (default: q/k/v-only biases, which Llama-style
        ``attention_bias`` does not express: it also biases o_proj)."""
        if arch.qkv_bias:
            # NOTE: megatron's add_qkv_bias biases q/k/v only; HF's attention_bias for these families also biases
            # o_proj, so the export would drop (qwen3) or refuse (llama) the trained biases
            raise RecipeError(f"q/k/v-only biases have no HF layout for {arch.family} (its attention_bias also biases "
                              "o_proj); leave qkv_bias unset, or use a qwen2 model", key="model.qkv_bias")

    # ---------------------------------------------------------------- training
    def data(self, *, recipe: Any, arch: Arch, runtime: Any, device: Any) -> Data:
        from loongforge_megatron.data.datasets import build_dataset

        tokenizer = tokenizer_for(recipe, runtime)
        if tokenizer is not None and len(tokenizer) > arch.vocab_size:
            raise RecipeError(f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {arch.vocab_size}",
                              key="model.vocab_size")
        t = recipe.train
        num_valid = (t.steps // t.eval_interval + 1) * t.eval_steps * t.global_batch_size if t.eval_interval else None
        train, valid = build_dataset(recipe, tokenizer=tokenizer, vocab_size=arch.vocab_size,
                                     num_samples=t.steps * t.global_batch_size, num_valid=num_valid)
        return Data(train=train, valid=valid, seq_length=recipe.data.seq_length, tokenizer=tokenizer,
                    assets=tokenizer_assets(recipe))

    def model(self, *, recipe: Any, arch: Arch, plan: Any, accelerator: Any, device: Any, precision: str,
              data: Data) -> Model:
        from loongforge_megatron.engine.model import build_chunks
        from loongforge_megatron.engine.weights import seeded_init

        config = transformer_config(arch, plan=plan, precision=precision,
                                    cpu_init=accelerator.device_type == "cpu" or recipe.model.init_on_cpu,
                                    grad_accum_fusion=recipe.kernels.grad_accum_fusion)
        spec_name = kernel_spec(recipe)
        moe = moe_kernels(recipe, arch, plan, accelerator=accelerator, config=config, spec_name=spec_name,
                          precision=precision)
        spec = layer_spec(config, arch, spec_name=spec_name, provider=recipe.kernels.provider, accelerator=accelerator,
                          moe=moe)
        mtp = None
        if arch.mtp_num_layers:
            from loongforge_megatron.engine.mtp import mtp_block_spec

            mtp = mtp_block_spec(getattr(spec, "mtp_layer", spec), depths=arch.mtp_num_layers)
        chunks = build_chunks(
            transformer_config=config,
            layer_spec=spec,
            mtp_block_spec=mtp,
            vocab_size=padded_vocab(arch.vocab_size, plan.tp),
            max_sequence_length=max(arch.max_position_embeddings, recipe.data.seq_length),
            rotary_base=arch.rope_theta,
            share_embeddings_and_output_weights=arch.tie_embeddings,
            vpp=plan.vpp,
            device=device,
            rope_scaling_factor=arch.rope_scaling_factor,
            rotary_percent=arch.rotary_percent,
            position_embedding_type="yarn" if arch.rope_yarn and not arch.is_mla else "rope",
        )
        seeded_init(chunks, config=config, seed=recipe.train.seed)
        forward_step = None
        if spec_name == "loongforge":
            from loongforge_megatron.layers.output import forward_step_with_fused_loss

            forward_step = forward_step_with_fused_loss(provider=recipe.kernels.provider, accelerator=accelerator)
        return Model(chunks=chunks, config=config, kernels=spec_name, forward_step=forward_step)

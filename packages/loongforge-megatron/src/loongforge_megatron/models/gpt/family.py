"""The GPT model kind: decoder-only LMs on megatron's ``GPTModel``. A family (``llama.py``, ``qwen3.py`` ...)
subclasses :class:`GPTFamily` with its presets, its own HF config fields both ways and its name map; building,
data, the forward step and the recipe checks are the kind's."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loongforge.errors import RecipeError

from loongforge_megatron.layers.selection import check_provider, decoder_layers, layer_set, moe_kernels
from loongforge_megatron.models.base import HFCheckpoint
from loongforge_megatron.models.gpt import names
from loongforge_megatron.models.gpt.arch import Arch
from loongforge_megatron.models.gpt.translate import arch_fields, hf_fields, transformer_config
from loongforge_megatron.models.lm import check_lm, no_compile, padded_vocab, tokenizer_assets, tokenizer_for
from loongforge_megatron.models.spec import Data, HFConfig, Model

if TYPE_CHECKING:
    from loongforge.checkpoint import NameMap


def _mtp_families() -> list[Any]:
    from loongforge_megatron.models import registry

    return [s for s in registry.all_specs().values() if s.mtp]


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
        if arch.mtp_num_layers and not self.mtp:
            have = sorted(s.name for s in _mtp_families())
            raise RecipeError(f"model.mtp_num_layers: the {self.name} family has no HF layout for multi-token "
                              f"prediction layers (families with one: {', '.join(have)})", key="model.mtp_num_layers")
        fp8 = recipe.train.fp8
        if fp8 is not None and fp8.output_layer and layer_set(recipe) == "loongforge":
            # NOTE: the loongforge spec computes the output layer inside its fused linear cross-entropy (bf16
            # GEMMs of its own): an FP8 output layer module would never run
            raise RecipeError("train.fp8.output_layer: the loongforge spec runs the output layer inside its fused "
                              "linear cross-entropy, in bf16; leave it false (or use kernels.layers local / te)",
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
        from loongforge_megatron.layers.output import mask_padded_vocab

        config = transformer_config(arch, plan=plan, precision=precision,
                                    cpu_init=accelerator.device_type == "cpu" or recipe.model.init_on_cpu,
                                    grad_accum_fusion=recipe.kernels.grad_accum_fusion)
        spec_name = layer_set(recipe)
        moe = moe_kernels(recipe, arch, plan, accelerator=accelerator, config=config, spec_name=spec_name,
                          precision=precision)
        spec = decoder_layers(config, arch, spec_name=spec_name, provider=recipe.kernels.provider, accelerator=accelerator,
                          moe=moe)
        spec = self.layers(spec, arch=arch)
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
        mask_padded_vocab(chunks, vocab_size=arch.vocab_size)
        forward_step = None
        if spec_name == "loongforge":
            from loongforge_megatron.layers.output import forward_step_with_fused_loss

            forward_step = forward_step_with_fused_loss(provider=recipe.kernels.provider, accelerator=accelerator)
        return self.finish(Model(chunks=chunks, config=config, kernels=spec_name, forward_step=forward_step),
                           recipe=recipe, arch=arch, accelerator=accelerator)

    def layers(self, spec: Any, *, arch: Arch) -> Any:
        """The decoder's layer spec as this family builds it (default: the kind's, unchanged)."""
        return spec

    def finish(self, model: Model, *, recipe: Any, arch: Arch, accelerator: Any) -> Model:
        """The built model with what the family adds to its training (default: nothing)."""
        return model

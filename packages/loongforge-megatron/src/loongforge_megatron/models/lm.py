"""What every language model shares, whichever kind holds it (a GPT family, a VLM's language model): the checks
of MoE / LoRA / expert TP / TransformerEngine / MTP / positions, the vocabulary padding, and the tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from loongforge.errors import RecipeError

from loongforge_megatron.layers.selection import te_incompatible
from loongforge_megatron.models.base import copy_assets

if TYPE_CHECKING:
    from loongforge_megatron.models.gpt.arch import Arch


# Vocabulary padding for TP: pad only to a multiple of tp (few rows); the padded rows' logits are -inf in every
# cross-entropy (layers.output.mask_padded_vocab), so the loss equals an unpadded model's at any tp.
VOCAB_DIVISIBLE_BY = 1


def padded_vocab(vocab_size: int, tp: int) -> int:
    from loongforge.checkpoint import padded_vocab_size

    return padded_vocab_size(vocab_size, divisible_by=VOCAB_DIVISIBLE_BY, tp_size=tp)


def no_compile(recipe: Any) -> None:
    """Language models get their fused kernels from ``kernels.layers``, not from ``train.compile``."""
    if recipe.train.compile:
        raise RecipeError("train.compile (torch.compile of each transformer layer) is for image models on this "
                          "backend; LLMs and VLMs get fused kernels from kernels.layers loongforge",
                          key="train.compile")


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
        if recipe.kernels.layers == "te":
            raise RecipeError("kernels.moe_grouped_gemm selects our grouped_mm experts of the loongforge / local "
                              "spec; kernels.layers te uses TransformerEngine's own experts", key="kernels.moe_grouped_gemm")
    if arch.is_moe and arch.moe_token_dispatcher == "permute":
        why = ("ep > 1" if plan.ep > 1 else f"expert tp {plan.etp}" if plan.etp > 1 else
               "moe_pad_to_capacity" if arch.moe_pad_to_capacity else
               "kernels.moe_grouped_gemm false" if recipe.kernels.moe_grouped_gemm is False else
               f"kernels.layers {recipe.kernels.layers}" if recipe.kernels.layers in ("te", "local") else None)
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
    if recipe.kernels.layers == "te" and te_needs:
        raise RecipeError(f"kernels.layers te cannot be used with {te_needs}: TransformerEngine's layers fold the norms "
                          "into the linears (other parameter names than the HF mappings know) and its causal "
                          "attention ignores packed-sequence masks; use kernels.layers loongforge", key="kernels.layers")
    if arch.mtp_num_layers and recipe.kernels.layers == "te":
        raise RecipeError("model.mtp_num_layers (multi-token prediction) is built on the loongforge / local spec; "
                          "kernels.layers te would need TransformerEngine's MTP modules", key="model.mtp_num_layers")
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


def tokenizer_for(recipe: Any, runtime: Any, *, prepare: bool = True) -> Any:
    """The run's tokenizer (preparing ``data.path`` on the main rank first, unless ``prepare`` is false: a records
    file read as is); None for synthetic data."""
    import torch.distributed as dist

    from loongforge_megatron.data.prepare import is_prepared, tokenizer_dir
    from loongforge_megatron.data.prepare import prepare as prepare_data
    from loongforge_megatron.data.tokenizer import load_tokenizer

    data = recipe.data
    if data.format == "synthetic":
        return None
    if prepare and data.path and not is_prepared(data.path):
        if runtime.is_main:
            prepare_data(recipe)
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

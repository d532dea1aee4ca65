"""Tokenizers: train a byte-level BPE during ``data prepare`` (saved in HF format), or load an HF one."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from loongforge.errors import RecipeError

SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>"}
# A minimal chat template for tokenizers that have none (the quickstart's own tokenizer).
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_bpe(texts: Iterable[str], *, vocab_size: int, out_dir: str | Path):
    """Train a byte-level BPE tokenizer on ``texts`` and save it as an HF ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL)
    fast.chat_template = DEFAULT_CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def load_tokenizer(path: str | Path):
    """Load an HF tokenizer from a local directory (never from the hub)."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise RecipeError(f"tokenizer directory '{path}' not found", key="data.tokenizer")
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise RecipeError(f"cannot load tokenizer from '{path}': {exc}".splitlines()[0], key="data.tokenizer") from None
    if tok.chat_template is None:
        tok.chat_template = DEFAULT_CHAT_TEMPLATE
    return tok


class MegatronTokenizerShim:
    """What megatron-core's GPTDataset reads from a tokenizer: ``vocab_size``, ``eod`` and ``pad``."""

    def __init__(self, hf_tokenizer):
        self.vocab_size = len(hf_tokenizer)
        self.eod = hf_tokenizer.eos_token_id
        self.pad = hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else self.eod
        self.unique_identifiers = {"class": "hf", "name": getattr(hf_tokenizer, "name_or_path", "")}

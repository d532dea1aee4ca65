"""``loongforge data prepare RECIPE``: tokenize the recipe's data source into megatron indexed datasets.

Writes into ``data.path``: ``tokenizer/`` (trained or copied), ``train.bin/.idx`` (pretraining: one document per
source document, EOS-terminated) or ``sft_tokens`` + ``sft_mask`` (SFT: one document per conversation), and
``prepared.json`` last, as the completion marker.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from loongforge.errors import RecipeError
from loongforge_megatron.data.sources import iter_documents
from loongforge_megatron.data.tokenizer import load_tokenizer, train_bpe

# megatron-core's import-time notices that TransformerEngine / Apex are missing (we run without them on purpose)
_MISSING_TE_APEX = r"(Transformer Engine and Apex are|Apex is) not installed"


def _not_no_cuda_notice(record: logging.LogRecord) -> bool:
    return "No CUDA runtime is found" not in record.getMessage()


def _indexed_dataset_builder() -> type:
    """megatron-core's ``IndexedDatasetBuilder``, imported without its TransformerEngine / Apex / no-CUDA notices.

    NOTE: the import pulls in megatron-core's optimizer package (warns that TE / Apex are missing) and
    torch.utils.cpp_extension (logs that a CPU-only host has no CUDA): noise to someone tokenizing data. Only
    those messages are dropped, and only while importing.
    """
    cpp_log = logging.getLogger("torch.utils.cpp_extension")
    cpp_log.addFilter(_not_no_cuda_notice)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_MISSING_TE_APEX, category=UserWarning, module="megatron")
            from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    finally:
        cpp_log.removeFilter(_not_no_cuda_notice)
    return IndexedDatasetBuilder


def is_prepared(path: str | Path) -> bool:
    return (Path(path) / "prepared.json").is_file()


def tokenizer_dir(recipe) -> Path | None:
    """The tokenizer a recipe uses: data.tokenizer, model.tokenizer, PATH/tokenizer, then model.hf."""
    data, model = recipe.data, recipe.model
    for candidate in (data.tokenizer, model.tokenizer):
        if candidate:
            return Path(candidate)
    if data.path and (Path(data.path) / "tokenizer").is_dir():
        return Path(data.path) / "tokenizer"
    if model.hf:
        return Path(model.hf)
    return None


def prepare(recipe, *, force: bool = False) -> Path:
    """Build the prepared data directory of ``recipe`` (no-op when already complete, unless ``force``)."""
    data = recipe.data
    if data.format not in ("pretrain", "sft"):
        # NOTE: synthetic data is made while training; a model kind's own format (records, images) is read as is
        raise RecipeError(f"data.format {data.format} needs no preparation (prepare writes pretrain / sft data)",
                          key="data.format")
    if not data.path:
        raise RecipeError("data prepare writes into data.path; set it", key="data.path")
    out = Path(data.path)
    if is_prepared(out) and not force:
        return out
    if data.source is None:
        raise RecipeError(f"'{out}' is not prepared and the recipe has no data.source to prepare it from", key="data.source")
    out.mkdir(parents=True, exist_ok=True)
    (out / "prepared.json").unlink(missing_ok=True)
    # NOTE: the sample-index caches describe the old corpus (they are also keyed by content: indexed_files.py)
    shutil.rmtree(out / "cache", ignore_errors=True)
    start = time.time()
    sft = data.format == "sft"
    origins: list[str] = []
    docs = list(iter_documents(data.source, sft=sft, origins=origins))
    if not docs:
        raise RecipeError("the data source yielded no documents", key="data.source")
    if data.train_tokenizer is not None:
        if sft:
            raise RecipeError("train_tokenizer is for pretraining text; SFT uses the model's tokenizer", key="data.train_tokenizer")
        print(f"[data] training a {data.train_tokenizer.vocab_size}-token BPE on {len(docs)} documents", file=sys.stderr)
        tok = train_bpe(docs, vocab_size=data.train_tokenizer.vocab_size, out_dir=out / "tokenizer")
    else:
        src = tokenizer_dir(recipe)
        if src is None:
            raise RecipeError("no tokenizer: set data.tokenizer, model.hf or data.train_tokenizer", key="data.tokenizer")
        tok = load_tokenizer(src)
        if src.resolve() != (out / "tokenizer").resolve():
            tok.save_pretrained(str(out / "tokenizer"))
    builder_cls = _indexed_dataset_builder()
    dtype = np.uint16 if len(tok) < 65500 else np.int32
    n_tokens = 0
    if sft:
        from loongforge_megatron.data.sft import sft_sample

        tb = builder_cls(str(out / "sft_tokens.bin"), dtype=dtype)
        mb = builder_cls(str(out / "sft_mask.bin"), dtype=np.uint16)
        supervised = 0
        for rec, origin in zip(docs, origins, strict=True):
            ids, mask = sft_sample(tok, rec, style=data.sft_style, origin=origin)
            ids, mask = ids[: data.seq_length + 1], mask[: data.seq_length + 1]
            tb.add_document(torch.tensor(ids), [len(ids)])
            mb.add_document(torch.tensor(mask), [len(mask)])
            n_tokens += len(ids)
            supervised += sum(mask[1:])  # NOTE: the first token is never a label
        if not supervised:
            raise RecipeError(f"the SFT data has no assistant tokens within data.seq_length {data.seq_length} (no "
                              f"record of {len(docs)} has an assistant turn that fits), so nothing would be trained",
                              key="data.source")
        tb.finalize(str(out / "sft_tokens.idx"))
        mb.finalize(str(out / "sft_mask.idx"))
    else:
        builder = builder_cls(str(out / "train.bin"), dtype=dtype)
        eos = tok.eos_token_id
        batch = 256
        for i in range(0, len(docs), batch):
            encoded = tok(docs[i : i + batch], add_special_tokens=False)["input_ids"]
            for ids in encoded:
                ids = list(ids) + [eos]
                builder.add_document(torch.tensor(ids), [len(ids)])
                n_tokens += len(ids)
        if n_tokens <= len(docs):  # NOTE: one EOS per document, nothing else
            raise RecipeError(f"the data source has no text ({len(docs)} documents, all empty): nothing to train on",
                              key="data.source")
        builder.finalize(str(out / "train.idx"))
    info = {"format": data.format, "documents": len(docs), "tokens": n_tokens, "vocab_size": len(tok), "seconds": round(time.time() - start, 1)}
    tmp = out / "prepared.json.tmp"
    tmp.write_text(json.dumps(info, indent=1))
    tmp.replace(out / "prepared.json")
    print(f"[data] {len(docs)} documents, {n_tokens} tokens -> {out} ({info['seconds']}s)", file=sys.stderr)
    return out


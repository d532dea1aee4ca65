"""Training datasets (pretrain via megatron-core's GPTDataset, packed SFT, synthetic) and the batch order.

Every dataset maps a global sample index to a dict of tensors: ``tokens``, ``labels``, ``loss_mask``,
``position_ids`` and, for packed SFT, ``cu_seqlens`` (the row's sample boundaries; rows are collated into packed
THD micro-batches, ``engine/packing.py``: no ``[s, s]`` mask). :class:`BatchSchedule` fixes
which samples form global batch ``step`` — the same samples whatever the data-parallel size, so losses are
comparable across layouts and resume is exact (the data position is the step).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import numpy as np
import torch
from loongforge.errors import RecipeError
from loongforge.parallel.balance import imbalance


class SyntheticDataset:
    """Random tokens, deterministic per (seed, index): for benchmarks and tests."""

    def __init__(self, *, vocab_size: int, seq_length: int, seed: int):
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        text = torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=g)
        return {
            "tokens": text[:-1],
            "labels": text[1:],
            "loss_mask": torch.ones(self.seq_length),
            "position_ids": torch.arange(self.seq_length),
        }


class PackedSFTDataset:
    """SFT samples packed into rows of ``seq_length`` without cross-sample attention, or one per row.

    A packed row carries ``cu_seqlens`` (its samples' boundaries; position ids restart at each) and
    ``num_tokens`` (its samples' tokens). ``pad_to``: every sample but a row's last starts at a multiple of it
    (``2 * cp`` under context parallelism, which cuts every sample into ``2 * cp`` chunks); the padding after a
    sample belongs to it and carries no loss. Rows of one sample each (``pack: false``) are plain causal: no
    boundaries.
    """

    def __init__(self, path: str | Path, *, seq_length: int, pad_id: int, pack: bool, pad_to: int = 1):
        from loongforge_megatron.data.indexed_files import check_indexed
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        n = {name: check_indexed(Path(path) / name) for name in ("sft_tokens", "sft_mask")}
        self.tokens = IndexedDataset(str(Path(path) / "sft_tokens"))
        self.mask = IndexedDataset(str(Path(path) / "sft_mask"))
        if n["sft_tokens"] != n["sft_mask"] or not np.array_equal(self.tokens.sequence_lengths, self.mask.sequence_lengths):
            raise RecipeError(f"{path}: sft_tokens and sft_mask do not describe the same samples; run `loongforge "
                              "data prepare --force` to rebuild them", key="data.path")
        if seq_length % pad_to:
            raise RecipeError(f"seq_length {seq_length} is not a multiple of {pad_to} (2 * cp)", key="data.seq_length")
        self.seq_length, self.pad_id, self.pack, self.pad_to = seq_length, pad_id, pack, pad_to
        self.rows = self._plan_rows()
        used = sum(len(self.tokens[i]) for i in range(len(self.tokens)))
        self.efficiency = used / max(1, len(self.rows) * (seq_length + 1))

    def _plan_rows(self) -> list[list[int]]:
        """Greedy in-order packing: samples are appended to the current row until it is full."""
        rows: list[list[int]] = []
        cur: list[int] = []
        fill = 0
        for i in range(len(self.tokens)):
            n = len(self.tokens[i])
            if cur and (not self.pack or fill + n > self.seq_length + 1):
                rows.append(cur)
                cur, fill = [], 0
            cur.append(i)
            fill += -(-n // self.pad_to) * self.pad_to  # the next sample starts at a multiple of pad_to
        if cur:
            rows.append(cur)
        return rows

    def __len__(self) -> int:
        return len(self.rows)

    def cost_features(self, idx: int) -> tuple[float, float, float]:
        """(Σl², Σl, image patches) of row ``idx``: l are the lengths its attention sees, read from the index alone
        (``loongforge.parallel.balance``). A packed row's samples with their padding, the last one through the
        row's end; a row of one sample attends all ``seq_length`` positions."""
        s = self.seq_length
        if not self.pack:
            return float(s * s), float(s), 0.0
        lengths, at = [], 0
        for i in self.rows[idx % len(self.rows)]:
            n = min(int(self.tokens.sequence_lengths[i]), s + 1 - at)
            span = min(-(-n // self.pad_to) * self.pad_to, s + 1 - at)
            lengths.append(span)
            at += span
        lengths[-1] += s - sum(lengths)  # NOTE: cu_seqlens ends at s: the last sample takes the row's tail
        return float(sum(x * x for x in lengths)), float(s), 0.0

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        s = self.seq_length
        tokens = torch.full((s + 1,), self.pad_id, dtype=torch.long)
        mask = torch.zeros(s + 1)
        segment = torch.full((s + 1,), -1, dtype=torch.long)
        position = torch.zeros(s + 1, dtype=torch.long)
        starts, at, used = [], 0, 0
        for seg, i in enumerate(self.rows[idx % len(self.rows)]):
            ids = torch.from_numpy(np.asarray(self.tokens[i], dtype=np.int64))
            m = torch.from_numpy(np.asarray(self.mask[i], dtype=np.float32))
            n = min(len(ids), s + 1 - at)
            span = min(-(-n // self.pad_to) * self.pad_to, s + 1 - at)  # the sample and the padding that is its own
            tokens[at : at + n], mask[at : at + n] = ids[:n], m[:n]
            segment[at : at + span], position[at : at + span] = seg, torch.arange(span)
            starts.append(at)
            used, at = used + max(0, min(n, s - at)), at + span  # tokens in the row's s inputs
        labels = tokens[1:].clone()
        # a label is trained only when it is an assistant token of the *same* sample as its input token
        loss_mask = mask[1:] * (segment[1:] == segment[:-1]).float() * (segment[1:] >= 0).float()
        row = {"tokens": tokens[:-1], "labels": labels, "loss_mask": loss_mask, "position_ids": position[:-1]}
        row["num_tokens"] = torch.tensor(used)
        if self.pack:
            row["cu_seqlens"] = torch.tensor([*starts, s], dtype=torch.int32)
        return row


def build_pretrain_dataset(recipe, *, tokenizer, num_samples: int, num_valid: int | None = None):
    """megatron-core ``GPTDataset`` splits (train, valid) over the recipe's blend (default ``data.path/train``);
    valid is None unless ``num_valid`` is given."""
    from loongforge_megatron.data.tokenizer import MegatronTokenizerShim
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    data = recipe.data
    if data.blend:
        prefixes, weights = [b.path for b in data.blend], [b.weight for b in data.blend]
    else:
        prefixes, weights = [str(Path(data.path) / "train")], None
    from loongforge_megatron.data.indexed_files import check_cache, check_indexed, content_key

    key = "data.blend" if data.blend else "data.path"
    for p in prefixes:
        if not Path(p + ".idx").is_file():
            raise RecipeError(f"dataset '{p}' not found (.idx missing); run `loongforge data prepare` first", key=key)
    counts = [check_indexed(p, key=key) for p in prefixes]
    documents = max(counts)
    _check_split_documents(data.split, dict(zip(prefixes, counts, strict=True)),
                           wanted={"train": num_samples, "validation": num_valid})
    # NOTE: keyed by the data's content: a corpus prepared again never reuses the old one's sample plan
    cache = Path(data.path or Path(prefixes[0]).parent) / "cache" / content_key(prefixes)
    check_cache(cache, num_documents=documents, key=key)
    config = GPTDatasetConfig(
        random_seed=recipe.train.seed,
        sequence_length=data.seq_length,
        blend=(prefixes, weights),
        split=data.split,
        path_to_cache=str(cache),
        tokenizer=MegatronTokenizerShim(tokenizer),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mmap_bin_files=True,
    )
    # NOTE: every rank reads its own samples (BatchSchedule), so the dataset exists on every rank; megatron's
    # builder still builds the index caches on rank 0 first and lets the others load them.
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, num_valid, None], lambda: True, config).build()
    if num_valid and valid is None:
        raise RecipeError(f"data.split '{data.split}' leaves no validation documents but train.eval_interval is set",
                          key="data.split")
    return train, valid


def _check_split_documents(split: str, documents: dict[str, int], *, wanted: dict[str, int | None]) -> None:
    """Every split that samples are asked of holds at least one document of every dataset, as megatron cuts them
    (a share that rounds to no document: megatron's GPTDataset would loop forever looking for its tokens)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for (name, samples), bounds in zip(wanted.items(), matrix, strict=False):
        if not samples or bounds is None:
            continue  # NOTE: a zero share with samples asked of it is refused after the build (no dataset)
        for prefix, n in documents.items():
            if int(round(bounds[1] * n)) - int(round(bounds[0] * n)) < 1:
                raise RecipeError(f"data.split '{split}' gives the {name} split none of the {n} documents of "
                                  f"'{prefix}'; raise its share, use a larger corpus"
                                  + (", or unset train.eval_interval" if name == "validation" else ""),
                                  key="data.split")


def build_dataset(recipe, *, tokenizer, vocab_size: int, num_samples: int, num_valid: int | None = None):
    """(train, valid) datasets of the recipe; valid is None without ``num_valid``."""
    data = recipe.data
    if data.format == "synthetic":
        train = SyntheticDataset(vocab_size=vocab_size, seq_length=data.seq_length, seed=recipe.train.seed)
        valid = SyntheticDataset(vocab_size=vocab_size, seq_length=data.seq_length, seed=recipe.train.seed + 1)
        return train, (valid if num_valid else None)
    if data.format == "sft":
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        cp = recipe.parallel.cp
        pack = data.pack is not False  # NOTE: unset is on
        ds = PackedSFTDataset(data.path, seq_length=data.seq_length, pad_id=pad, pack=pack,
                              pad_to=2 * cp if cp > 1 and pack else 1)
        print(f"[data] SFT: {len(ds.tokens)} samples in {len(ds)} rows of {data.seq_length} tokens, "
              f"packing efficiency {100 * ds.efficiency:.1f}%", file=sys.stderr)
        return ds, None
    return build_pretrain_dataset(recipe, tokenizer=tokenizer, num_samples=num_samples, num_valid=num_valid)


class BatchSchedule:
    """Which samples this data-parallel rank reads for each micro-batch of global batch ``step``.

    Global batch ``step`` is samples ``[step*G, (step+1)*G)``; micro-batch m of dp rank r takes
    ``step*G + m*M*D + r*M + [0, M)`` (G global batch, M micro batch, D dp size).

    ``workers`` > 0 (``data.num_workers``): the steps' micro-batches are made ahead, in order, by that many worker
    processes (torch's DataLoader, spawned: the trainer may have compiled graphs, so no fork), while the model
    trains on the current step; a step asked for out of that order (a resume, an evaluation) restarts them there.
    The batches are the same either way: each is a function of its step alone.

    ``balancer`` (``data.balance``): the same global batch, its samples placed over the ranks and micro-batches by
    their cost (the dataset's ``cost_features(idx)``); each micro-batch then carries ``cost_features`` (its summed
    features, for the cost fit) and ``dp_imbalance`` (max / mean rank cost before and after).

    A dataset may also say how its micro-batches are made: ``concat_keys`` (per-sample sizes, joined on their first
    dimension), ``finish_batch(batch)`` (a model's own host work on a collated micro-batch, done where the batch is
    made: in a worker when there are workers) and ``host_keys`` (metadata its model reads on the host, left there
    when the micro-batch moves to the device).
    """

    def __init__(self, dataset, *, global_batch_size: int, micro_batch_size: int, dp_size: int, dp_rank: int,
                 workers: int = 0, steps: int | None = None, balancer=None):
        self.dataset = dataset
        self.balancer = balancer  # NOTE: a loongforge.parallel.balance.LoadBalancer places the step's samples
        if balancer is not None and not hasattr(dataset, "cost_features"):
            raise RecipeError(f"data.balance: this model's {type(dataset).__name__} gives no per-sample costs",
                              key="data.balance")
        self.gbs, self.mbs, self.dp, self.rank = global_batch_size, micro_batch_size, dp_size, dp_rank
        self.num_microbatches = global_batch_size // (micro_batch_size * dp_size)
        self.workers, self.steps = workers, steps
        self._ahead, self._next = None, None  # the workers' iterator and the step it yields next

    def microbatches(self, step: int, *, device: torch.device) -> list[dict[str, torch.Tensor]]:
        out = []
        keep = getattr(self.dataset, "host_keys", ())  # NOTE: metadata its model reads on the host (a VLM's grids)
        for batch in self._prefetched(step) if self.workers else self.host_batches(step):
            batch = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) and k not in keep else v
                     for k, v in batch.items()}
            for key, dtype in (("tokens", torch.long), ("labels", torch.long), ("position_ids", torch.long),
                               ("loss_mask", torch.float)):
                if key in batch:  # NOTE: an image model's samples have labels but no tokens
                    batch[key] = batch[key].to(dtype)
            out.append(batch)
        return out

    def _prefetched(self, step: int) -> list[dict[str, torch.Tensor]]:
        if self._next != step:
            self.close()
            from torch.utils.data import DataLoader

            end = max(self.steps or 0, step + 1)
            loader = DataLoader(_Steps(self), batch_size=None, sampler=range(step, end), num_workers=self.workers,
                                prefetch_factor=2, multiprocessing_context="spawn", persistent_workers=False)
            self._ahead = _without_sigchld_raise(loader)
        try:
            batches = next(self._ahead)
        except StopIteration:  # NOTE: past the planned steps (a run extended on resume): the next call restarts
            self._next = None
            return self.host_batches(step)
        except Exception:  # noqa: BLE001 - NOTE: a worker's error (a bad record, a killed worker): the step is
            # made here again, so a data error surfaces as itself (one line naming the record), not as a worker's
            # traceback, and a lost worker costs one step made in-process
            self.close()
            return self.host_batches(step)
        self._next = step + 1
        return batches

    def close(self) -> None:
        """Stop the prefetching workers (if any)."""
        ahead, self._ahead, self._next = self._ahead, None, None
        # NOTE: now, not when the iterator is collected: after a worker's error a traceback may still hold it
        shutdown = getattr(ahead, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def host_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """Step ``step``'s micro-batches of this rank, on the host."""
        out = []
        n = len(self.dataset)
        concat = getattr(self.dataset, "concat_keys", ())  # NOTE: per-sample sizes differ (a VLM's image patches)
        finish = getattr(self.dataset, "finish_batch", None)  # NOTE: a model's per-micro-batch host work
        placed = self._placement(step) if self.balancer is not None else None
        for m in range(self.num_microbatches):
            first = step * self.gbs + m * self.mbs * self.dp + self.rank * self.mbs
            if placed is None:
                picks = [first + b for b in range(self.mbs)]
            else:
                picks = [step * self.gbs + k for k in placed[0].microbatches[self.rank][m]]
            samples = [self.dataset[i % n] for i in picks]
            if "cu_seqlens" in samples[0]:  # packed rows: one THD micro-batch (engine/packing.py)
                from loongforge_megatron.engine.packing import collate

                batch = collate(samples, concat_keys=concat)
            else:
                batch = {}
                for key in samples[0]:
                    if key in concat:
                        batch[key] = torch.cat([s[key] for s in samples])
                    elif key != "num_tokens":
                        batch[key] = torch.stack([torch.as_tensor(np.asarray(s[key])) if not isinstance(s[key], torch.Tensor) else s[key] for s in samples])
                if "num_tokens" in samples[0]:
                    batch["real_tokens"] = int(sum(int(s["num_tokens"]) for s in samples))
            if placed is not None:
                placement, features = placed
                mine = placement.microbatches[self.rank][m]
                batch["cost_features"] = tuple(sum(features[k][j] for k in mine) for j in range(3))
                batch["dp_imbalance"] = (imbalance(placement.before), imbalance(placement.after))
            out.append(finish(batch) if finish is not None else batch)
        return out

    def _placement(self, step: int):
        """(placement, features) of global batch ``step``: every rank computes the same from the dataset's index."""
        n = len(self.dataset)
        features = [self.dataset.cost_features((step * self.gbs + k) % n) for k in range(self.gbs)]
        placement = self.balancer.place(features, step=step, ranks=self.dp, microbatches=self.num_microbatches,
                                        micro_batch_size=self.mbs)
        return placement, features


def _without_sigchld_raise(loader):
    """``iter(loader)`` with the process's SIGCHLD handler as it was before.

    NOTE: torch's DataLoader installs a SIGCHLD handler that raises ``RuntimeError: DataLoader worker (pid ...) is
    killed`` in the main thread wherever it is when a worker dies (inside the model's step, a checkpoint save),
    which no caller can catch. Without it the iterator still notices a dead worker itself, in ``next()`` (it polls
    its workers while waiting for a batch), where :meth:`BatchSchedule._prefetched` makes that step in-process.
    """
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGCHLD"):
        return iter(loader)
    previous = signal.getsignal(signal.SIGCHLD)
    try:
        return iter(loader)
    finally:
        signal.signal(signal.SIGCHLD, previous if previous is not None else signal.SIG_DFL)


class _Steps(torch.utils.data.Dataset):
    """Item ``step``: that step's host micro-batches (what a prefetching worker makes)."""

    def __init__(self, schedule: BatchSchedule):
        # NOTE: a copy without the prefetching state: this is what the workers receive
        self.schedule = BatchSchedule(schedule.dataset, global_batch_size=schedule.gbs, micro_batch_size=schedule.mbs,
                                      dp_size=schedule.dp, dp_rank=schedule.rank, balancer=schedule.balancer)

    def __getitem__(self, step: int) -> list[dict[str, torch.Tensor]]:
        return self.schedule.host_batches(step)

"""The streaming engine: a source yields one HF tensor group at a time, sinks shard or gather it.

A *group* is the HF tensors one megatron parameter is built from (q/k/v, gate/up, or one tensor), keyed by
their HF names. Sources: an HF directory, or megatron rank shards (files or in-memory state dicts). Sinks:
megatron rank files, one rank's state dict, or an HF directory. Every conversion is source -> sink, so peak
memory is one group plus its shards.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from loongforge.checkpoint import (
    Expert,
    Param,
    RowParallel,
    SafetensorsReader,
    ShardedSafetensorsWriter,
    StreamingSafetensorsFile,
)
from loongforge.errors import CheckpointError

from loongforge_megatron.conversion.aliased_reader import AliasedReader
from loongforge_megatron.conversion.fp8_blocks import BlockFp8, Fp8Export, fp8_reader, modules_to_not_convert
from loongforge_megatron.conversion.layout import MegatronLayout, Rank
from loongforge_megatron.models.registry import get_family

Key = tuple[str, ...]
Spec = tuple[torch.dtype, tuple[int, ...]]
Group = dict[str, torch.Tensor]  # role -> tensor


def key_of(p: Param) -> Key:
    return tuple(p.hf[r] for r in p.rule.roles)


def _explain(p: Param, group: dict[str, Spec], err: Exception) -> CheckpointError:
    shapes = ", ".join(f"'{p.hf[r]}' {tuple(s)}" for r, (_, s) in group.items())
    return CheckpointError(f"cannot build '{p.megatron}' from {shapes}: {err}")


Runs = list[tuple[int, int, int]]  # (first row in the destination, first source id or 0 = zero rows, count)


def _row_ids(rows: dict[str, int]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """1-based row ids per role (0 stays free for padding rows), with a gap between roles so that no run of
    consecutive ids crosses from one role into the next. Returns (role -> ids, role -> first id)."""
    ids, first, nxt = {}, {}, 1
    for role, n in rows.items():
        ids[role], first[role] = torch.arange(nxt, nxt + n), nxt
        nxt += n + 1
    return ids, first


def _runs(ids: torch.Tensor) -> Runs:
    """Maximal runs of consecutive ids (or of zeros) in a 1-D id vector."""
    runs: list[list[int]] = []
    for pos, v in enumerate(ids.tolist()):
        if runs and ((v and runs[-1][1] and v == runs[-1][1] + runs[-1][2]) or (not v and not runs[-1][1])):
            runs[-1][2] += 1
        else:
            runs.append([pos, v, 1])
    return [tuple(r) for r in runs]


def row_streamable(p: Param, specs: dict[str, Spec]) -> bool:
    return p.rule.row_wise and all(len(s) >= 1 for _, s in specs.values())


def _load_libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _load_libc() if sys.platform.startswith("linux") else None


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS after each group (glibc only; a no-op elsewhere).

    NOTE: glibc raises its mmap threshold to the size of the last freed block (up to 32 MiB), so after the
    first few layers mid-sized shards live on the heap, whose holes are never returned: without this, resident
    memory grew by ~100 MiB over a 16-layer conversion.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class Progress:
    """Progress lines on stderr, at most one every ~2 s (plus the final one)."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done, self._last = total, label, 0, 0.0

    def step(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self._last > 2.0 or self.done == self.total:
            self._last = now
            print(f"[loongforge {self.label}] {self.done}/{self.total} tensor groups", file=sys.stderr, flush=True)


class HFSource:
    """Reads groups from an HF safetensors directory (lazily, one tensor at a time). Block-scaled FP8 weights are
    dequantized as they are read, to ``dtype`` (default: the checkpoint's own dtype)."""

    def __init__(self, hf_dir: str | Path, *, family: str, hf_config: dict, dtype: torch.dtype | None = None):
        self.family, self.hf_config = get_family(family), hf_config
        self.raw = fp8_reader(SafetensorsReader(hf_dir), hf_config, where=Path(hf_dir) / "config.json", dtype=dtype)
        self.reader = AliasedReader(self.raw, self.family.hf_alias)

    def check_names(self, needed: Iterable[Key]) -> None:
        """Fail naming the first HF tensor the architecture needs but the checkpoint lacks (or vice versa)."""
        want = {n for k in needed for n in k}
        # NOTE: a tensor the map needs is never ignored (a family ignores MTP layers only when not training them)
        have = {n for n in self.reader.keys() if n in want or not self.family.ignore_hf(self.hf_config, n)}
        if missing := sorted(want - have):
            raise CheckpointError(
                f"{self.reader.path}: missing tensor '{missing[0]}' (+{len(missing) - 1} more) for family "
                f"'{self.family.name}'; the checkpoint does not match config.json"
            )
        if unexpected := sorted(have - want):
            raise CheckpointError(
                f"{self.reader.path}: unexpected tensor '{unexpected[0]}' (+{len(unexpected) - 1} more) for "
                f"family '{self.family.name}'; the checkpoint does not match config.json"
            )

    def spec(self, p: Param) -> dict[str, Spec]:
        return {r: (self.reader.dtype(n), self.reader.shape(n)) for r, n in p.hf.items()}

    def get(self, p: Param) -> Group:
        return {r: self.reader.get(n) for r, n in p.hf.items()}

    def read_shard(self, p: Param, *, index: int, size: int, spec: Spec) -> torch.Tensor:
        """Shard ``index`` of a row-wise parameter, filled with positioned reads of just its HF rows (the
        group is never materialised): peak memory is the shard itself."""
        specs = self.spec(p)
        ids, first = _row_ids({r: s[0] for r, (_, s) in specs.items()})
        where = p.rule.to_megatron(ids, tp_rank=index, tp_size=size)
        out = torch.empty(spec[1], dtype=spec[0])
        for pos, v, n in _runs(where):
            if not v:
                out[pos:pos + n].zero_()
                continue
            role = max((r for r in first if first[r] <= v), key=first.get)
            self.reader.read_rows(p.hf[role], v - first[role], out[pos:pos + n])
        return out


    def read_column_shard(self, p: Param, *, index: int, size: int) -> torch.Tensor | None:
        """Shard ``index`` of a row-parallel (dim-1 split) parameter from a block-scaled FP8 weight, dequantizing
        only its columns; None for any other parameter or tensor."""
        rule = p.rule.inner if isinstance(p.rule, Expert) and not p.rule.fused else p.rule
        if not isinstance(rule, RowParallel) or len(p.hf) != 1:
            return None
        (role, name), = p.hf.items()
        shape = self.reader.shape(name)
        if len(shape) != 2:
            return None
        try:
            cols = rule.to_megatron({role: torch.arange(shape[1]).unsqueeze(0)}, tp_rank=index, tp_size=size)[0]
        except CheckpointError:
            return None  # NOTE: the whole-group path names the problem
        return self.reader.read_columns(name, cols)


class MegatronSource:
    """Gathers groups from megatron shards; ``read(rank, name)`` / ``shape(rank, name)`` abstract the storage."""

    def __init__(
        self, layout: MegatronLayout, *,
        read: Callable[[Rank, str], torch.Tensor], spec: Callable[[Rank, str], Spec],
    ):
        self.layout, self._read, self._spec = layout, read, spec
        # NOTE: several parameters make one HF group where HF fuses the experts (each fills its row of dim 0)
        self.members: dict[Key, list[Param]] = {}
        for q in layout.params():
            if q.export:
                self.members.setdefault(key_of(q), []).append(q)
        self.params = {key: ps[0] for key, ps in self.members.items()}

    def _p(self, p: Param) -> Param:
        try:
            return self.params[key_of(p)]
        except KeyError:
            raise CheckpointError(f"the megatron checkpoint has no parameter for HF {key_of(p)}") from None

    def _rows(self, p: Param) -> list[Param] | None:
        """The parameters that fill the rows of a fused HF tensor, by row (None: one parameter makes the group)."""
        src = self._p(p)
        if src.rule.hf_row is None:
            return None
        return sorted(self.members[key_of(p)], key=lambda q: q.rule.hf_row)

    def _meta(self, src: Param) -> Group:
        shard_specs = [self._spec(rank, src.megatron) for rank in self.layout.shard_sources(src)]
        return src.rule.to_hf([torch.empty(s, dtype=d, device="meta") for d, s in shard_specs])

    def spec(self, p: Param) -> dict[str, Spec]:
        rows = self._rows(p)
        meta = self._meta(self._p(p))
        if rows is not None:
            return {r: (t.dtype, (len(rows), *t.shape[1:])) for r, t in meta.items()}
        return {r: (t.dtype, tuple(t.shape)) for r, t in meta.items()}

    def _get_one(self, src: Param) -> Group:
        return src.rule.to_hf([self._read(rank, src.megatron) for rank in self.layout.shard_sources(src)])

    def get(self, p: Param) -> Group:
        rows = self._rows(p)
        if rows is None:
            return self._get_one(self._p(p))
        parts = [self._get_one(q) for q in rows]
        return {r: torch.cat([part[r] for part in parts]) for r in parts[0]}

    def _row_plan(self, src: Param) -> list[tuple[Rank, list[tuple[str, int, int, int]]]] | None:
        """For a row-wise parameter: per shard source, the (role, HF row, shard row, count) runs it supplies
        (the rule is run on row ids to learn where each shard row lands). None when not row-wise."""
        ranks = self.layout.shard_sources(src)
        shard_specs = [self._spec(rank, src.megatron) for rank in ranks]
        if not row_streamable(src, dict(enumerate(shard_specs))):
            return None
        ids, first = _row_ids({i: s[0] for i, (_, s) in enumerate(shard_specs)})
        runs = {role: _runs(t) for role, t in src.rule.to_hf(list(ids.values())).items()}
        plan = []
        for i, rank in enumerate(ranks):
            lo, hi = first[i], first[i] + shard_specs[i][1][0]
            plan.append((rank, [(role, pos, v - lo, n) for role, rs in runs.items() for pos, v, n in rs if lo <= v < hi]))
        return plan

    def reads(self, p: Param) -> list[tuple[Rank, str]]:
        """The (shard source, megatron name) reads of ``write_rows``, in order (senders mirror this in a
        distributed export)."""
        rows = self._rows(p)
        if rows is not None:
            return [(rank, q.megatron) for q in rows for rank in self.layout.shard_sources(q)]
        src = self._p(p)
        plan = self._row_plan(src)
        ranks = self.layout.shard_sources(src) if plan is None else [rank for rank, mine in plan if mine]
        return [(rank, src.megatron) for rank in ranks]

    def write_rows(self, p: Param, put: Callable[[str, int, torch.Tensor], None]) -> None:
        """Stream ``p``'s HF tensors out as ``put(role, first_row, rows)`` calls, one shard in memory at a
        time for row-wise rules, one expert at a time for fused experts; replicas (e.g. norms) are read from one
        rank only."""
        rows = self._rows(p)
        if rows is not None:
            for q in rows:
                for role, t in self._get_one(q).items():
                    put(role, q.rule.hf_row, t)
            return
        src = self._p(p)
        plan = self._row_plan(src)
        if plan is None:
            for role, t in self.get(p).items():
                put(role, 0, t)
            return
        for rank, mine in plan:
            if not mine:
                continue
            shard = self._read(rank, src.megatron)
            for role, pos, row, n in mine:
                put(role, pos, shard[row:row + n])
            del shard


def file_source(root: str | Path, layout: MegatronLayout) -> MegatronSource:
    """A MegatronSource over the rank files of an offline checkpoint (each opened lazily)."""
    readers: dict[Rank, SafetensorsReader] = {}

    def reader(rank: Rank) -> SafetensorsReader:
        if rank not in readers:
            readers[rank] = SafetensorsReader(layout.rank_file(root, rank))
        return readers[rank]

    return MegatronSource(
        layout,
        read=lambda rank, name: reader(rank).get(name),
        spec=lambda rank, name: (reader(rank).dtype(name), reader(rank).shape(name)),
    )


def shard(layout: MegatronLayout, p: Param, group: Group, index: int) -> torch.Tensor:
    size = layout.split_size(p)
    try:
        return p.rule.to_megatron(group, tp_rank=index, tp_size=size)
    except CheckpointError as exc:
        hf = list(p.hf.values())
        more = f" (+{len(hf) - 1} more)" if len(hf) > 1 else ""
        raise CheckpointError(f"cannot build '{p.megatron}' from '{hf[0]}'{more}: {exc}") from None


def _targets(layout: MegatronLayout) -> dict[Key, list[Param]]:
    out: dict[Key, list[Param]] = {}
    for p in layout.params():
        out.setdefault(key_of(p), []).append(p)
    return out


def hf_params(layout: MegatronLayout) -> list[Param]:
    """One representative parameter per HF group, in HF order (what an HF export writes; a fused experts tensor's
    is its first expert's)."""
    out: dict[Key, Param] = {}
    for p in layout.params():
        if p.export:
            out.setdefault(key_of(p), p)
    return list(out.values())


def to_megatron_files(source, layout: MegatronLayout, root: Path, *, label: str = "convert") -> None:
    """Shard every group from ``source`` into the rank files of ``layout`` under ``root``."""
    targets = _targets(layout)
    rank_specs: dict[Rank, dict[str, Spec]] = {r: {} for r in layout.ranks()}
    for params in targets.values():
        group_spec = source.spec(params[0])
        for p in params:
            try:
                shape = p.rule.shard_shape({r: s for r, (_, s) in group_spec.items()}, tp_size=layout.split_size(p))
            except (CheckpointError, RuntimeError) as e:
                raise _explain(p, group_spec, e) from None
            dtype = next(iter(group_spec.values()))[0]
            for rank, _ in layout.holders(p):
                rank_specs[rank][p.megatron] = (dtype, shape)
    files = {}
    for rank, specs in rank_specs.items():
        path = layout.rank_file(root, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        files[rank] = StreamingSafetensorsFile(path, specs)
    progress = Progress(len(targets), label)
    for params in targets.values():
        if hasattr(source, "read_shard") and row_streamable(params[0], source.spec(params[0])):
            for p in params:
                by_index: dict[int, list[Rank]] = {}
                for rank, index in layout.holders(p):
                    by_index.setdefault(index, []).append(rank)
                for index, ranks in by_index.items():
                    t = source.read_shard(p, index=index, size=layout.split_size(p),
                                          spec=rank_specs[ranks[0]][p.megatron])
                    for rank in ranks:
                        files[rank].write(p.megatron, t)
                    del t
        else:
            group = source.get(params[0])
            for p in params:
                for rank, index in layout.holders(p):
                    files[rank].write(p.megatron, shard(layout, p, group, index))
            del group
        release_freed_memory()
        progress.step()
    for f in files.values():
        f.close()


def check_export_config(staging: Path, specs: dict[str, Spec], *, family: Any) -> None:
    """An export never writes a config.json that disagrees with the tensors beside it: the written config is read
    back and checked against the tensors' specs (named as the export will name them)."""
    from loongforge_megatron.conversion.config_check import SpecReader, check_hf_dir
    from loongforge_megatron.models.registry import complete, load_config_json

    path = staging / "config.json"
    if not path.is_file():
        return
    cfg = complete(family, load_config_json(path), path)
    try:
        check_hf_dir(staging, cfg, family=family, reader=SpecReader(specs))
    except CheckpointError as exc:
        raise CheckpointError(f"the exported {str(exc).replace(str(path), 'config.json', 1)}; nothing was written") \
            from None


def to_hf_dir(source, layout: MegatronLayout, out_dir: Path, *, max_shard_bytes: int, force: bool,
              assets: Callable[[Path], None] | None = None, fp8: BlockFp8 | None = None) -> None:
    """Gather every exported group from ``source`` into an HF safetensors directory (atomic, sharded), plus the
    family's ``hf_extra`` tensors (HF modules the megatron model does not have). ``fp8``: store the decoder
    layers' linear weights block-scaled FP8 (``assets`` writes the config.json that says so)."""
    params = hf_params(layout)
    specs: dict[str, Spec] = {}
    for p in params:
        for r, spec in source.spec(p).items():
            specs[p.hf[r]] = spec
    dtype = next(iter(specs.values()))[0] if specs else torch.float32
    family = get_family(layout.family)
    extra = {k: t.to(dtype) for k, t in family.hf_extra(layout.hf_config).items()}
    specs.update({k: (t.dtype, tuple(t.shape)) for k, t in extra.items()})
    from loongforge_megatron.conversion.config_check import SpecReader, check_config

    # NOTE: the layout's own config must describe the shards too (a tampered layout file, a lying model config)
    check_config(f"the {layout.family} layout's hf_config", layout.hf_config, family=family, reader=SpecReader(specs),
                 mtp_layers=layout.mtp_layers)
    quant = Fp8Export(fp8, specs, skip=modules_to_not_convert(layout.hf_config)) if fp8 is not None else None
    if quant is not None:
        specs = quant.specs(specs)
    writer = ShardedSafetensorsWriter(out_dir, specs, max_shard_bytes=max_shard_bytes, force=force,
                                      stem=family.hf_weights)
    add_rows = writer.add_rows if quant is None else functools.partial(quant.add_rows, writer)
    try:
        progress = Progress(len(params), "export")
        for p in params:
            source.write_rows(p, lambda role, row, t, p=p: add_rows(p.hf[role], row, t))
            release_freed_memory()
            progress.step()
        for k, t in extra.items():
            writer.add(k, t)
        if assets is not None:
            assets(writer.staging_dir)
        check_export_config(writer.staging_dir, specs, family=family)
    except BaseException:
        writer.abort()
        raise
    writer.commit()

"""Typed split/merge rules: each owns how one parameter is sharded over tensor (or expert) parallel ranks.

A rule turns the HF tensor(s) of one parameter into the shard that one TP rank holds (``to_megatron``) and
the list of all ranks' shards back into HF tensors (``to_hf``). Models never re-implement sharding: a model
family is a name map whose entries point at these rules. Multi-tensor rules (fused QKV, gated MLP) name their
HF inputs by *role* (``q``/``k``/``v``, ``gate``/``up``); single-tensor rules use the role ``"t"``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, replace

import torch

from loongforge.errors import CheckpointError

Tensor = torch.Tensor
SINGLE = "t"


def _split(t: Tensor, *, dim: int, parts: int, what: str) -> tuple[Tensor, ...]:
    if t.shape[dim] % parts:
        raise CheckpointError(f"{what}: dim {dim} of shape {tuple(t.shape)} is not divisible by {parts}")
    return torch.chunk(t, parts, dim=dim)


def padded_vocab_size(vocab_size: int, *, divisible_by: int, tp_size: int) -> int:
    """Megatron's padded vocabulary: rounded up to a multiple of ``divisible_by * tp_size``."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


class Rule(abc.ABC):
    """Base class. ``roles`` names the HF tensors this rule consumes, in order."""

    roles: tuple[str, ...] = (SINGLE,)
    # NOTE: True when both directions only move (or zero-pad) whole dim-0 rows. The engine then runs the
    # rule on 1-D row-index vectors to learn where each row goes, and copies rows straight between files.
    row_wise: bool = False

    @abc.abstractmethod
    def to_megatron(self, hf_tensors: dict[str, Tensor], *, tp_rank: int, tp_size: int) -> Tensor:
        """This TP rank's megatron shard from the HF tensors of ``roles``."""

    @abc.abstractmethod
    def to_hf(self, shards: list[Tensor]) -> dict[str, Tensor]:
        """The HF tensors (by role) from every TP rank's shard, in rank order."""

    @property
    def hf_row(self) -> int | None:
        """The dim-0 row of the HF tensor this parameter fills when several parameters make one HF tensor (fused
        experts); None: it makes the whole tensor."""
        return None

    def shard_shape(self, hf_shapes: dict[str, tuple[int, ...]], *, tp_size: int) -> tuple[int, ...]:
        """Shape of one rank's shard, computed without data (used for dry runs and shape checks)."""
        fake = {k: torch.empty(s, device="meta") for k, s in hf_shapes.items()}
        return tuple(self.to_megatron(fake, tp_rank=0, tp_size=tp_size).shape)


@dataclass(frozen=True)
class Replicated(Rule):
    """Every rank holds the whole tensor (norms, routers, biases of row-parallel layers).

    HF [a, b]  ->  rank0 [a, b] | rank1 [a, b] | ...
    """

    row_wise = True

    def to_megatron(self, hf_tensors, *, tp_rank, tp_size):
        return hf_tensors[SINGLE]

    def to_hf(self, shards):
        return {SINGLE: shards[0]}


@dataclass(frozen=True)
class Reshaped(Rule):
    """Replicated, with another shape on the backend side (e.g. CLIP's class embedding [h] <-> megatron's
    class token [1, 1, h]).

    HF ``hf_shape``  ->  every rank ``shape``
    """

    shape: tuple[int, ...]
    hf_shape: tuple[int, ...]

    def to_megatron(self, hf_tensors, *, tp_rank, tp_size):
        return hf_tensors[SINGLE].reshape(self.shape)

    def to_hf(self, shards):
        return {SINGLE: shards[0].reshape(self.hf_shape)}


@dataclass(frozen=True)
class Shared(Rule):
    """One tensor the backend holds once and HF repeats under ``copies`` names (e.g. diffusers' DiT keeps a copy
    of the shared timestep / class embedder in every block). Replicated over TP. Import refuses copies that
    differ (the backend could not represent them); export writes the tensor under every name.

    HF  name_0 [a, b] == name_1 [a, b] == ...   ->  every rank [a, b]
    """

    copies: int

    @property
    def roles(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(str(i) for i in range(self.copies))

    def to_megatron(self, hf_tensors, *, tp_rank, tp_size):
        return _one_of_copies(hf_tensors, self.roles, rule="Shared")

    def to_hf(self, shards):
        return {role: shards[0] for role in self.roles}


def _one_of_copies(hf_tensors: dict[str, torch.Tensor], roles: tuple[str, ...], *, rule: str) -> torch.Tensor:
    """Copy ``"0"`` of a tensor HF repeats under several names; a copy that differs is a clear error."""
    first = hf_tensors["0"]
    for role in roles[1:]:
        t = hf_tensors[role]
        if t.shape != first.shape or (first.device.type != "meta" and not torch.equal(t, first)):
            raise CheckpointError(f"{rule}: copy {role} differs from copy 0 (the backend holds one tensor for all "
                                  f"{len(roles)} copies)")
    return first


@dataclass(frozen=True)
class Copies(Rule):
    """One parameter sharded by ``inner`` that HF repeats under ``copies`` names (DeepSeek's multi-token
    prediction layers repeat the embedding and the output head). Import refuses copies that differ; export
    writes the merged tensor under every name.

    HF  name_0 == name_1 == ...   --inner-->   rank shards of name_0
    """

    inner: Rule
    copies: int

    @property
    def roles(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(str(i) for i in range(self.copies))

    def to_megatron(self, hf_tensors, *, tp_rank, tp_size):
        first = _one_of_copies(hf_tensors, self.roles, rule="Copies")
        return self.inner.to_megatron({SINGLE: first}, tp_rank=tp_rank, tp_size=tp_size)

    def to_hf(self, shards):
        t = self.inner.to_hf(shards)[SINGLE]
        return {role: t for role in self.roles}


@dataclass(frozen=True)
class ColumnParallel(Rule):
    """Split the output dimension (dim 0) evenly; weights and biases of column-parallel linears.

    HF [out, in]  ->  rank0 [out/tp, in]  (rows 0..out/tp)
                      rank1 [out/tp, in]  (next rows) ...

    ``stride`` s > 1: the rows are s stacked blocks (a fused q / k / v projection, s = 3), each split evenly; a rank
    holds its slice of every block, in block order (megatron's ``partition_stride``).
    """

    stride: int = 1
    row_wise = True

    def to_megatron(self, hf_tensors, *, tp_rank, tp_size):
        pieces = _split(hf_tensors[SINGLE], dim=0, parts=tp_size * self.stride, what="ColumnParallel")
        return torch.cat(pieces[tp_rank::tp_size], dim=0) if self.stride > 1 else pieces[tp_rank]

    def to_hf(self, shards):
        if self.stride == 1:
            return {SINGLE: torch.cat(shards, dim=0)}
        blocks = [s.chunk(self.stride, dim=0) for s in shards]
        return {SINGLE: torch.cat([b[j] for j in range(self.stride) for b in blocks], dim=0)}


@dataclass(frozen=True)
class RowParallel(Rule):
    """Split the input dimension (dim 1) evenly; weights of row-parallel linears (o_proj, down_proj).

    HF [out, in]  ->  rank0 [out, in/tp] | rank1 [out, in/tp] | ...   (columns side by side)
    """

    def to_megatron(self, hf_tensors, *, tp_rank, tp_size):
        return _split(hf_tensors[SINGLE], dim=1, parts=tp_size, what="RowParallel")[tp_rank]

    def to_hf(self, shards):
        return {SINGLE: torch.cat(shards, dim=1)}


@dataclass(frozen=True)
class VocabParallel(Rule):
    """Embedding / output layer: pad the vocab with zero rows to a multiple of ``divisible_by * tp``, then
    split dim 0. Export concatenates and strips the padding back to ``vocab_size`` rows.

    HF [V, h]  ->  pad to [V', h]  ->  rank0 [V'/tp, h] | rank1 [V'/tp, h]      (V' = padded_vocab_size)
    """

    row_wise = True

    vocab_size: int
    divisible_by: int = 128

    def to_megatron(self, hf_tensors, *, tp_rank, tp_size):
        t = hf_tensors[SINGLE]
        if t.shape[0] != self.vocab_size:
            raise CheckpointError(f"VocabParallel: expected {self.vocab_size} rows, got {tuple(t.shape)}")
        padded = padded_vocab_size(self.vocab_size, divisible_by=self.divisible_by, tp_size=tp_size)
        rows = padded // tp_size
        lo, hi = tp_rank * rows, (tp_rank + 1) * rows
        shard = t[lo:min(hi, self.vocab_size)]
        if shard.shape[0] < rows:  # NOTE: only the last rank(s) carry padding; build just that shard.
            pad = t.new_zeros((rows - shard.shape[0], *t.shape[1:]))
            shard = torch.cat([shard, pad], dim=0)
        return shard

    def to_hf(self, shards):
        return {SINGLE: torch.cat(shards, dim=0)[: self.vocab_size]}


@dataclass(frozen=True)
class FusedQKV(Rule):
    """HF q/k/v projections -> megatron ``linear_qkv`` with the GQA interleave, split across TP by groups.

    With G query groups and H/G query heads per group (d = head_dim), along dim 0:
        [ q(g0: H/G heads) ; k(g0) ; v(g0) ; q(g1) ; k(g1) ; v(g1) ; ... ]
    rank r holds groups r*G/tp .. (r+1)*G/tp-1 (whole groups). Works for weights [*, hidden] and biases [*].
    """

    num_heads: int
    num_query_groups: int
    head_dim: int
    roles: tuple[str, ...] = ("q", "k", "v")
    row_wise = True

    def _check(self, tp_size: int) -> None:
        if self.num_heads % self.num_query_groups or self.num_query_groups % tp_size:
            raise CheckpointError(
                f"FusedQKV: heads={self.num_heads}, groups={self.num_query_groups} need heads % groups == 0 "
                f"and groups % tp == 0 (tp={tp_size})"
            )

    def to_megatron(self, hf_tensors, *, tp_rank, tp_size):
        self._check(tp_size)
        q, k, v = hf_tensors["q"], hf_tensors["k"], hf_tensors["v"]
        g, per = self.num_query_groups, self.num_heads // self.num_query_groups
        want = {"q": self.num_heads * self.head_dim, "k": g * self.head_dim, "v": g * self.head_dim}
        for role, t in (("q", q), ("k", k), ("v", v)):
            if t.shape[0] != want[role] or t.shape[1:] != q.shape[1:]:
                raise CheckpointError(
                    f"FusedQKV: {role} has shape {tuple(t.shape)}, expected {want[role]} rows "
                    f"(heads={self.num_heads}, groups={g}, head_dim={self.head_dim})"
                )
        rest = q.shape[1:]
        groups = slice(tp_rank * g // tp_size, (tp_rank + 1) * g // tp_size)
        qg = q.reshape(g, per * self.head_dim, *rest)[groups]
        kg = k.reshape(g, self.head_dim, *rest)[groups]
        vg = v.reshape(g, self.head_dim, *rest)[groups]
        return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)

    def to_hf(self, shards):
        g, per, d = self.num_query_groups, self.num_heads // self.num_query_groups, self.head_dim
        full = torch.cat(shards, dim=0)
        rest = full.shape[1:]
        qg, kg, vg = torch.split(full.reshape(g, (per + 2) * d, *rest), [per * d, d, d], dim=1)
        return {"q": qg.reshape(-1, *rest), "k": kg.reshape(-1, *rest), "v": vg.reshape(-1, *rest)}


@dataclass(frozen=True)
class GatedMLP(Rule):
    """HF gate_proj + up_proj -> megatron ``linear_fc1``: each rank holds [gate shard ; up shard].

    gate [I, h], up [I, h]  ->  rank r: [ gate rows r*I/tp..(r+1)*I/tp ; up rows (same) ]   ([2I/tp, h])
    """

    row_wise = True

    roles: tuple[str, ...] = ("gate", "up")

    def to_megatron(self, hf_tensors, *, tp_rank, tp_size):
        if hf_tensors["gate"].shape != hf_tensors["up"].shape:
            raise CheckpointError(
                f"GatedMLP: gate {tuple(hf_tensors['gate'].shape)} and up {tuple(hf_tensors['up'].shape)} differ"
            )
        gate = _split(hf_tensors["gate"], dim=0, parts=tp_size, what="GatedMLP gate")[tp_rank]
        up = _split(hf_tensors["up"], dim=0, parts=tp_size, what="GatedMLP up")[tp_rank]
        return torch.cat([gate, up], dim=0)

    def to_hf(self, shards):
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return {"gate": torch.cat([h[0] for h in halves], 0), "up": torch.cat([h[1] for h in halves], 0)}


@dataclass(frozen=True)
class Expert(Rule):
    """Routed experts: ``inner`` shards each expert over *expert* tensor parallel (ETP) ranks, and experts
    are distributed over EP ranks in contiguous blocks.

    E experts, ep ranks:   ep0: experts 0..E/ep-1 (local 0..)  |  ep1: experts E/ep..2E/ep-1 (local 0..) | ...
    global expert e  <->  (ep_rank = e // (E/ep), local = e % (E/ep));  within one expert: ``inner`` over ETP.
    """

    inner: Rule
    num_experts: int

    @property
    def roles(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.inner.roles

    @property
    def row_wise(self) -> bool:  # type: ignore[override]
        return self.inner.row_wise

    def per_rank(self, ep_size: int) -> int:
        if self.num_experts % ep_size:
            raise CheckpointError(f"Expert: {self.num_experts} experts are not divisible by ep={ep_size}")
        return self.num_experts // ep_size

    def locate(self, expert: int, *, ep_size: int) -> tuple[int, int]:
        """Global expert index -> (ep_rank, local index)."""
        n = self.per_rank(ep_size)
        return expert // n, expert % n

    def global_index(self, local: int, *, ep_rank: int, ep_size: int) -> int:
        return ep_rank * self.per_rank(ep_size) + local

    #: the HF tensor holds every expert along dim 0 (:class:`FusedExperts`): each expert's parameter supplies
    #: row ``hf_row`` of it, and the HF patterns have no expert wildcard
    fused = False

    def for_expert(self, expert: int) -> Expert:
        """The rule of global expert ``expert``'s parameter (the same rule: HF names it on its own)."""
        return self

    def to_megatron(self, hf_tensors, *, tp_rank, tp_size):
        return self.inner.to_megatron(hf_tensors, tp_rank=tp_rank, tp_size=tp_size)

    def to_hf(self, shards):
        return self.inner.to_hf(shards)


@dataclass(frozen=True)
class FusedExperts(Expert):
    """Routed experts that HF stores as one 3-D tensor (transformers' fused ``experts.gate_up_proj`` /
    ``experts.down_proj``), megatron as one linear per expert, spread over EP and sharded over ETP by ``inner``.

    HF [E, a, b]: expert e = row e of dim 0, ``[out, in]`` (a linear weight) or ``[in, out]`` (transposed)
        row e  ->  [out, in]  ->  ``inner``'s roles, concatenated along out (gate_up: [gate ; up])
               ->  ``inner`` over ETP  ->  ep rank e // (E/ep), local expert e % (E/ep)

    Import reads either orientation, as transformers 5 does (``Transpose(check_dims=True)``): a slice of shape
    ``(out_features, in_features)`` is taken as a linear weight, anything else must be its transpose. Export writes
    ``[in, out]`` when ``transposed`` (the published checkpoints' layout, e.g. Qwen3-VL-MoE's gate_up_proj
    [E, H, 2I]), else ``[out, in]`` (what transformers 5's ``save_pretrained`` writes); a square expert always as
    ``[out, in]``, the only way transformers 5 reads it. ``to_hf`` gives one expert's row ``[1, a, b]``; the engine
    stacks the experts' rows.
    """

    out_features: int = 0  # the whole linear's output size (gate_up: 2 x intermediate)
    in_features: int = 0
    transposed: bool = True
    expert: int | None = None
    fused = True

    @property
    def roles(self) -> tuple[str, ...]:  # type: ignore[override]
        return (SINGLE,)

    @property
    def hf_row(self) -> int | None:  # type: ignore[override]
        return self.expert

    @property
    def row_wise(self) -> bool:  # type: ignore[override]
        return False  # NOTE: one expert is a slice (maybe transposed) of the HF tensor, not some of its rows

    def for_expert(self, expert: int) -> FusedExperts:
        if not 0 <= expert < self.num_experts:
            raise CheckpointError(f"FusedExperts: expert {expert} is outside the {self.num_experts} experts")
        return replace(self, expert=expert)

    def _linear(self, t: Tensor) -> Tensor:
        """Expert ``self.expert``'s ``[out, in]`` weight from the fused HF tensor."""
        want = (self.out_features, self.in_features)
        if t.dim() != 3 or t.shape[0] != self.num_experts or tuple(t.shape[1:]) not in (want, want[::-1]):
            raise CheckpointError(f"FusedExperts: expected [{self.num_experts}, {want[0]}, {want[1]}] or "
                                  f"[{self.num_experts}, {want[1]}, {want[0]}], got {tuple(t.shape)}")
        if self.expert is None:
            raise CheckpointError("FusedExperts: the rule is not bound to an expert (NameMap.expand binds it)")
        w = t[self.expert]
        return w if tuple(w.shape) == want else w.t()

    def to_megatron(self, hf_tensors, *, tp_rank, tp_size):
        w = self._linear(hf_tensors[SINGLE])
        parts = torch.chunk(w, len(self.inner.roles), dim=0)
        return self.inner.to_megatron(dict(zip(self.inner.roles, parts, strict=True)), tp_rank=tp_rank,
                                      tp_size=tp_size)

    def to_hf(self, shards):
        parts = self.inner.to_hf(shards)
        w = torch.cat([parts[r] for r in self.inner.roles], dim=0)
        # NOTE: a square expert's orientation cannot be told from its shape: transformers 5 takes it as [out, in]
        transpose = self.transposed and self.out_features != self.in_features
        return {SINGLE: (w.t() if transpose else w).contiguous().unsqueeze(0)}

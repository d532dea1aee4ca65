"""Split/merge rules of the hybrid layers' fused projections: HF's per-section tensors <-> megatron's per-head-group
layout, which a plain dim-0 split shards over TP (whole groups per rank)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from loongforge.checkpoint import Rule
from loongforge.errors import CheckpointError


def _chunk(t: torch.Tensor, *, parts: int, what: str) -> tuple[torch.Tensor, ...]:
    if t.shape[0] % parts:
        raise CheckpointError(f"{what}: {t.shape[0]} rows do not split into {parts} equal parts")
    return torch.chunk(t, parts, dim=0)


@dataclass(frozen=True)
class Regrouped(Rule):
    """HF tensors made of sections (each spanning every head group) -> megatron rows grouped per head group.

    ``sections``: per role, the row count of each of its sections, e.g. a gated DeltaNet's ``in_proj_qkv``
    ``(q, k, v)`` and ``in_proj_z`` ``(z,)``. With G groups::

        HF  qkv = [ q(g0..gG) ; k(g0..gG) ; v(g0..gG) ],  z = [ z(g0..gG) ]
        megatron  [ q(g0) k(g0) v(g0) z(g0) ; q(g1) k(g1) v(g1) z(g1) ; ... ]   rank r: groups r*G/tp ..
    """

    groups: int
    sections: tuple[tuple[str, tuple[int, ...]], ...]
    row_wise = True

    @property
    def roles(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(role for role, _ in self.sections)

    def _grouped(self, hf_tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        pieces = []
        rest = None
        for role, sizes in self.sections:
            t = hf_tensors[role]
            if t.shape[0] != sum(sizes):
                raise CheckpointError(f"Regrouped: {role} has {t.shape[0]} rows, expected {sum(sizes)} "
                                      f"(sections {list(sizes)})")
            rest = t.shape[1:]
            for part in torch.split(t, list(sizes), dim=0):
                if part.shape[0] % self.groups:
                    raise CheckpointError(f"Regrouped: a section of {part.shape[0]} rows of {role} does not split "
                                          f"into {self.groups} head groups")
                pieces.append(part.reshape(self.groups, -1, *rest))
        return torch.cat(pieces, dim=1).reshape(-1, *rest)

    def to_megatron(self, hf_tensors, *, tp_rank, tp_size):
        if self.groups % tp_size:
            raise CheckpointError(f"Regrouped: {self.groups} head groups do not split over tp {tp_size}")
        return _chunk(self._grouped(hf_tensors), parts=tp_size, what="Regrouped")[tp_rank]

    def to_hf(self, shards):
        full = torch.cat(shards, dim=0)
        rest = full.shape[1:]
        per_group = [s // self.groups for _, sizes in self.sections for s in sizes]
        parts = iter(torch.split(full.reshape(self.groups, -1, *rest), per_group, dim=1))
        out = {}
        for role, sizes in self.sections:
            out[role] = torch.cat([next(parts).reshape(-1, *rest) for _ in sizes], dim=0)
        return out


@dataclass(frozen=True)
class GatedQKV(Rule):
    """Gated attention's projections: HF ``q_proj`` (per head ``[q ; gate]``), ``k_proj``, ``v_proj`` -> megatron's
    ``linear_qkv`` with an output gate (``attention_output_gate``), whole query groups per TP rank::

        per group g (H/G heads of dim d):  [ q(heads of g) ; gate(heads of g) ; k(g) ; v(g) ]
    """

    num_heads: int
    num_query_groups: int
    head_dim: int
    roles: tuple[str, ...] = ("q", "k", "v")
    row_wise = True

    def to_megatron(self, hf_tensors, *, tp_rank, tp_size):
        g, d = self.num_query_groups, self.head_dim
        per = self.num_heads // g
        if self.num_heads % g or g % tp_size:
            raise CheckpointError(f"GatedQKV: heads={self.num_heads}, groups={g} need heads % groups == 0 and "
                                  f"groups % tp == 0 (tp={tp_size})")
        q, k, v = hf_tensors["q"], hf_tensors["k"], hf_tensors["v"]
        for role, t, rows in (("q", q, 2 * self.num_heads * d), ("k", k, g * d), ("v", v, g * d)):
            if t.shape[0] != rows:
                raise CheckpointError(f"GatedQKV: {role} has {t.shape[0]} rows, expected {rows} (heads="
                                      f"{self.num_heads}, groups={g}, head_dim={d})")
        rest = q.shape[1:]
        q2 = q.reshape(g, per, 2, d, *rest)
        full = torch.cat([q2[:, :, 0].reshape(g, per * d, *rest), q2[:, :, 1].reshape(g, per * d, *rest),
                          k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
        return full.reshape(g, -1, *rest)[tp_rank * g // tp_size:(tp_rank + 1) * g // tp_size].reshape(-1, *rest)

    def to_hf(self, shards):
        g, d = self.num_query_groups, self.head_dim
        per = self.num_heads // g
        full = torch.cat(shards, dim=0)
        rest = full.shape[1:]
        q, gate, k, v = torch.split(full.reshape(g, -1, *rest), [per * d, per * d, d, d], dim=1)
        q = torch.stack([q.reshape(g, per, d, *rest), gate.reshape(g, per, d, *rest)], dim=2)
        return {"q": q.reshape(-1, *rest), "k": k.reshape(-1, *rest), "v": v.reshape(-1, *rest)}

"""An encoder on ranks of its own: ``parallel.components.vision.num_ranks`` and
``parallel.components.language.num_ranks`` split the world into two rank sets (the plan's disjoint ranges, in
declaration order).

Each set gets megatron-core's model-parallel state of its own layout (:func:`initialize_model_parallel`), so the
language model's ranks run the usual schedule, DDP and optimizer, and the encoder ranks run megatron's DDP and
optimizer over the tower alone. A step:

1. every encoder rank reads the micro-batches of the language data-parallel ranks it serves (language dp rank
   ``r`` is served by encoder rank ``r % num_ranks``: each image of the global batch is encoded once), runs the
   tower on each and sends the embeddings to every language rank of that dp rank (:class:`EncoderServer`);
2. the language ranks' first-stage forwards read them (:class:`EncoderClient`, the decoupled encoder's cache:
   ``engine/decoupled_encoder.py``); after the schedule's backward, tensor-parallel rank 0 of each dp rank sends the
   embeddings' gradients back;
3. the encoder ranks run one backward through the tower, reduce its gradients over their own data parallelism and
   divide them by the step's token count (the language ranks' loss normaliser, shared with the loss);
4. each set steps its own optimizer with the gradient norm of both (megatron's
   :class:`~megatron.core.models.mimo.optimizer.MimoOptimizer`: each set's squared norm, all-reduced over the world).

NOTE: megatron's ``BridgeCommunicator`` moves one dense ``[s, b, h]`` activation per pipeline message, split on
its batch dimension; the embeddings of a micro-batch are ragged (one row per merged patch of each of its images),
so they travel as plain point-to-point messages over the default process group, whose shapes both sides compute
from the micro-batch's images (every rank reads its batches' images).
"""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

ENCODER, LANGUAGE = "vision", "language"


@dataclass(frozen=True)
class RankSets:
    """The two rank sets of a plan with disjoint components: the encoder's plan and the language model's (each a
    resolved :class:`~loongforge.parallel.plan.ParallelPlan` of its own world, ``first_rank`` its offset)."""

    encoder: Any
    language: Any

    def on_encoder(self, rank: int) -> bool:
        return self.encoder.first_rank <= rank < self.encoder.first_rank + self.encoder.world_size

    def encoder_of(self, dp_rank: int) -> int:
        """The global rank that encodes language data-parallel rank ``dp_rank``'s images."""
        return self.encoder.first_rank + dp_rank % self.encoder.world_size

    def dp_ranks_of(self, rank: int) -> list[int]:
        """The language data-parallel ranks encoder rank ``rank`` serves."""
        return [r for r in range(self.language.dp) if self.encoder_of(r) == rank]

    def language_ranks_of(self, dp_rank: int) -> list[int]:
        """The language ranks of data-parallel rank ``dp_rank``: its tensor-parallel ranks, TP rank 0 first."""
        return self._language_tp_groups[dp_rank]

    @functools.cached_property
    def _language_tp_groups(self) -> dict[int, list[int]]:
        """{dp rank: its TP group} from megatron-core's grid of the language ranks (``HyperCommGrid`` over
        ``tp-cp-dp-pp`` from the set's first rank, megatron's rank order; enumerated, no group made)."""
        from megatron.core.hyper_comm_grid import HyperCommGrid

        lm = self.language
        grid = HyperCommGrid([lm.tp, lm.cp, lm.dp, lm.pp], ["tp", "cp", "dp", "pp"], rank_offset=lm.first_rank)
        dp_of = {r: i for group in grid.get_rank_enum("dp") for i, r in enumerate(group)}
        return {dp_of[g[0]]: g for g in grid.get_rank_enum("tp")}


def rank_sets(plan: Any) -> RankSets | None:
    """The plan's two rank sets, or None when every component runs on all of the ranks (or the components are
    not the two the backend runs apart: ``models/vision_component.py`` refuses those)."""
    disjoint = {n: c for n, c in plan.components.items() if c.world_size != plan.world_size or c.first_rank}
    if not disjoint or set(plan.components) != {ENCODER, LANGUAGE}:
        return None
    return RankSets(encoder=plan.components[ENCODER], language=plan.components[LANGUAGE])


def language_plan(plan: Any) -> Any:
    """The plan the language model runs with: its own component's where the encoder has ranks of its own."""
    sets = rank_sets(plan)
    if sets is None and any(c.world_size != plan.world_size or c.first_rank for c in plan.components.values()):
        from loongforge_megatron.models.vision_component import check_own_ranks

        check_own_ranks(plan)  # NOTE: components the backend does not run apart: refused naming them
    return plan if sets is None else sets.language


def _state(mpu: types.ModuleType) -> dict[str, Any]:
    """megatron's parallel-state globals (containers copied: a later initialisation appends to its lists)."""
    return {k: copy.copy(v) if isinstance(v, list | dict | set) else v for k, v in vars(mpu).items()
            if k.startswith("_") and not k.startswith("__") and not callable(v) and not isinstance(v, types.ModuleType)}


def initialize_model_parallel(sets: RankSets, **common: Any) -> None:
    """megatron-core's model-parallel state of this rank's set: its groups over its own ranks.

    NOTE: ``initialize_model_parallel`` lays a layout over ``local_world_size`` ranks from ``rank_offset``, but
    every rank of the world must take part in creating every group (``torch.distributed.new_group``), and its
    globals are set once. So every rank initialises both layouts, in order, from the same starting state, and keeps
    the state of the one it is a member of."""
    from megatron.core import parallel_state as mpu

    me, start, mine = dist.get_rank(), _state(mpu), None
    for plan in sorted((sets.encoder, sets.language), key=lambda p: p.first_rank):
        vars(mpu).update(_state(types.SimpleNamespace(**start)))
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=plan.tp, pipeline_model_parallel_size=plan.pp,
            virtual_pipeline_model_parallel_size=plan.vpp if plan.vpp > 1 else None, context_parallel_size=plan.cp,
            expert_model_parallel_size=plan.ep, expert_tensor_parallel_size=plan.etp, rank_offset=plan.first_rank,
            local_world_size=plan.world_size, **common)
        if plan.first_rank <= me < plan.first_rank + plan.world_size:
            mine = _state(mpu)
    vars(mpu).update(mine)


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def share_loss(total: torch.Tensor | None, sets: RankSets, *, lr: float = 0.0) -> tuple[torch.Tensor, float]:
    """The step's ``[loss sum, tokens]`` (the language ranks' :func:`~loongforge_megatron.engine.step.loss_total`)
    and learning rate on every rank of the world. Collective."""
    buf = torch.zeros(3, dtype=torch.float64, device=_comm_device())
    if total is not None:
        buf[:2], buf[2] = total.to(buf), lr
    dist.broadcast(buf, src=sets.language.first_rank)
    buf = buf.cpu()
    return buf[:2], float(buf[2])


def tower_trains(chunks: Sequence[torch.nn.Module], sets: RankSets) -> bool:
    """Whether the encoder's tower has parameters to train (``train.freeze``), known on every rank. Collective."""
    mine = any(p.requires_grad for c in chunks for p in c.parameters()) if sets.on_encoder(dist.get_rank()) else False
    flag = torch.tensor([int(mine)], dtype=torch.int32, device=_comm_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def global_norm_optimizer(optimizer: Any, sets: RankSets) -> Any:
    """This rank's megatron optimizer inside megatron's MIMO optimizer, whose gradient norm (and so the clipping)
    is that of both rank sets."""
    from megatron.core.models.mimo.optimizer import MimoOptimizer, ModuleOptimizerInfo

    encoder = sets.on_encoder(dist.get_rank())
    infos = {ENCODER: ModuleOptimizerInfo(optimizer if encoder else None, None, None, encoder),
             LANGUAGE: ModuleOptimizerInfo(None if encoder else optimizer, None, None, not encoder)}
    return MimoOptimizer(infos, optimizer.config)


class EncoderClient:
    """The language model's side of a step (the interface of ``DecoupledEncoders``): ``encode`` receives every
    micro-batch's embeddings into the first-stage chunk's encoder cache, ``backward`` sends their gradients back.
    The chunk (unwrapped) gives ``encoder_shape(batch) -> shape | None``: the embeddings the encoder makes of a
    micro-batch (None without images)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], sets: RankSets, *, trains: bool) -> None:
        from megatron.core import parallel_state as mpu

        from loongforge_megatron.engine.model import unwrap

        self.model, self.sets, self.trains = unwrap(chunks[0]), sets, trains
        self.src = sets.encoder_of(mpu.get_data_parallel_rank())
        self.sends = trains and mpu.get_tensor_model_parallel_rank() == 0

    def __bool__(self) -> bool:
        return True

    def encode(self, batches: Sequence[Any]) -> None:
        from loongforge_megatron.engine.decoupled_encoder import EncoderCache

        device, dtype = next(self.model.parameters()).device, self.model.config.params_dtype
        outs, works = [], []
        for b in batches:
            shape = self.model.encoder_shape(b)
            buf = None if shape is None else torch.empty(shape, dtype=dtype, device=_comm_device())
            if buf is not None:
                works.append(dist.irecv(buf, src=self.src))
            outs.append(buf)
        for w in works:
            w.wait()
        self.model.encoder_cache = EncoderCache(
            [None if o is None else o.to(device).requires_grad_(self.trains) for o in outs])

    def backward(self) -> None:
        cache = self.model.encoder_cache
        if cache is None:
            return
        if self.sends:
            for out, leaf in zip(cache.outputs, cache.leaves, strict=True):
                if out is not None:
                    grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                    dist.send(grad.detach().to(_comm_device()).contiguous(), dst=self.src)
        cache.outputs, cache.leaves = [], []

    def close(self) -> None:
        self.model.encoder_cache = None

    def share(self, total: torch.Tensor, *, lr: float) -> None:
        """The step's ``[loss sum, tokens]`` and learning rate to every rank (:func:`share_loss`)."""
        share_loss(total, self.sets, lr=lr)


class EncoderServer:
    """The encoder's side of a step: its tower (``chunks``: one DDP-wrapped chunk whose module has
    ``encode(batch) -> embeddings | None``) over the micro-batches of the language dp ranks it serves
    (``schedules``: {dp rank: its BatchSchedule})."""

    def __init__(self, chunks: Sequence[torch.nn.Module], sets: RankSets, schedules: dict[int, Any], *,
                 trains: bool) -> None:
        from loongforge_megatron.engine.model import unwrap

        self.chunks, self.sets, self.schedules, self.trains = list(chunks), sets, schedules, trains
        self.model = unwrap(self.chunks[0])

    def train_step(self, step: int, *, optimizer: Any, scheduler: Any, global_batch_size: int,
                   device: torch.device) -> dict[str, Any]:
        """One step (the encoder ranks' :func:`~loongforge_megatron.engine.step.train_step`): the same world
        collectives as the language ranks', in the same order."""
        from loongforge_megatron.engine.step import step_is_finite

        if self.trains:
            for m in self.chunks:
                m.zero_grad_buffer()
        optimizer.zero_grad()
        sent, works = [], []
        context = torch.enable_grad() if self.trains else torch.no_grad()
        for r, schedule in self.schedules.items():
            for b in schedule.microbatches(step, device=device):
                with context:
                    out = self.model.encode(b)
                if out is None:
                    continue
                payload = out.detach().to(_comm_device()).contiguous()
                works += [dist.isend(payload, dst=dst) for dst in self.sets.language_ranks_of(r)]
                sent.append((r, out, payload))
        for w in works:
            w.wait()
        if self.trains and sent:
            grads = []
            for r, _, payload in sent:
                grad = torch.empty_like(payload)
                dist.recv(grad, src=self.sets.language_ranks_of(r)[0])
                grads.append(grad.to(sent[0][1].device))
            torch.autograd.backward([out for _, out, _ in sent], grads)
        total, lr = share_loss(None, self.sets)
        if self.trains:
            for m in self.chunks:
                m.finish_grad_sync()  # NOTE: summed over the encoder's data-parallel ranks (per-token loss)
                m.scale_gradients(1.0 / float(total[1].clamp(min=1)))
        loss = float(total[0] / total[1].clamp(min=1))
        finite = step_is_finite(self.chunks, loss, optimizer)
        updated, grad_norm = False, float("nan")
        if finite:
            updated, grad_norm, _ = optimizer.step()
        if updated:
            scheduler.step(increment=global_batch_size)
        return {"loss": loss, "grad_norm": None if grad_norm is None else float(grad_norm), "lr": lr,
                "skipped": not updated, "nonfinite": not finite}

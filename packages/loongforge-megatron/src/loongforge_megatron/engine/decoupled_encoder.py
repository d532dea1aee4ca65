"""Decoupled encoder: under pipeline parallelism a VLM's vision tower runs outside megatron's pipeline schedule.

Inline, the tower runs inside the first stage's forward of every micro-batch, so that stage's micro-batches are
slower than the others' (and uneven, with the images). Decoupled, the first stage encodes all of the step's
micro-batches *before* the schedule starts (each image once; with encoder hetero-DP split over the tower's copies),
the schedule's first-stage forwards read those embeddings as leaves of their own autograd graphs (the schedule's
stages then run the language model alone), and after the schedule's last backward one backward pass runs the
accumulated embedding gradients through the tower, before the gradients' data-parallel reduction. The numbers are
the inline ones: the same operations, only moved.

A model takes part (``parallel.components.vision.decoupled``) by giving its first-stage chunk (unwrapped) three
things: ``decoupled = True``, ``encode_ahead(batch) -> output | None`` (the tower's output for one micro-batch: a
tensor or a tuple / list of them; None without images) and an ``encoder_cache`` attribute its forward reads
(:meth:`EncoderCache.take`, one per micro-batch, in order).

NOTE: only the first stage's ranks encode, and the later stages wait while they do: at pp 2 the step is no
faster than with the tower inline, and with uneven images slower (``benchmarks/hetero_vlm.py`` models both; the
later stages encoding a share too is what would make it faster). The tower's activations of every micro-batch are
held until the schedule ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

REPLAY_ATTR = "_loongforge_replaying"  # set on a tower while its forward returns a cached output


def _leaves(out: Any) -> Any:
    """``out`` with every tensor replaced by a detached copy that starts a new autograd graph (a leaf that
    requires a gradient where the tower's output did)."""
    if isinstance(out, torch.Tensor):
        return out.detach().requires_grad_(out.requires_grad)
    if isinstance(out, tuple | list):
        return type(out)(_leaves(o) for o in out)
    return out


def _pairs(out: Any, leaf: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(tower output, its leaf's gradient) for every tensor of ``out`` that the schedule's backward reached."""
    if isinstance(out, torch.Tensor):
        if out.requires_grad and leaf.grad is not None:
            yield out, leaf.grad
    elif isinstance(out, tuple | list):
        for o, lf in zip(out, leaf, strict=True):
            yield from _pairs(o, lf)


class EncoderCache:
    """One step's tower outputs (one per micro-batch, in the schedule's order) and the leaves the schedule read."""

    def __init__(self, outputs: Sequence[Any]) -> None:
        self.outputs, self.leaves = list(outputs), []

    def take(self) -> Any:
        """The next micro-batch's tower output, as leaves (their gradients collect over the schedule)."""
        if len(self.leaves) == len(self.outputs):
            raise RuntimeError(f"the pipeline's first stage ran more than the step's {len(self.outputs)} "
                               f"micro-batches through the decoupled encoder")
        leaf = _leaves(self.outputs[len(self.leaves)])
        self.leaves.append(leaf)
        return leaf

    def backward(self) -> None:
        """The embeddings' gradients through the tower (one autograd call for every micro-batch)."""
        outs, grads = [], []
        for out, leaf in zip(self.outputs, self.leaves, strict=False):
            for o, g in _pairs(out, leaf):
                outs.append(o)
                grads.append(g)
        if outs:
            torch.autograd.backward(outs, grads)
        self.outputs, self.leaves = [], []


class DecoupledEncoders:
    """The decoupled towers of this rank's model chunks (none off the first pipeline stage, or where the plan does
    not decouple the tower)."""

    def __init__(self, chunks: Sequence[torch.nn.Module]) -> None:
        from loongforge_megatron.engine.model import unwrap

        self.models = [m for m in (unwrap(c) for c in chunks)
                       if getattr(m, "pre_process", False) and getattr(m, "decoupled", False)]

    def __bool__(self) -> bool:
        return bool(self.models)

    def encode(self, batches: Sequence[Any]) -> None:
        """Every micro-batch through each tower, before the schedule (collective over the towers' own groups)."""
        for m in self.models:
            m.encoder_cache = EncoderCache([m.encode_ahead(b) for b in batches])

    def backward(self) -> None:
        """After the schedule's backward, before the gradient reduction."""
        for m in self.models:
            if m.encoder_cache is not None:
                m.encoder_cache.backward()

    def close(self) -> None:
        """Back to the inline tower (an evaluation's forward-only schedule encodes inside the stage)."""
        for m in self.models:
            m.encoder_cache = None


@contextlib.contextmanager
def replaying(tower: torch.nn.Module, output: Any) -> Iterator[None]:
    """Within the block, calling ``tower`` returns ``output`` (an encoding made ahead) instead of running it; a
    tower whose forward is inside a model we do not own (one of megatron-core's) reads its cache this way.
    ``output`` None: the tower runs as usual."""
    if output is None:
        yield
        return
    tower.forward = lambda *args, **kwargs: output
    setattr(tower, REPLAY_ATTR, True)
    try:
        yield
    finally:
        del tower.forward
        setattr(tower, REPLAY_ATTR, False)

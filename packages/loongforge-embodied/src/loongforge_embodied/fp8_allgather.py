"""Delta-FP8 parameter all-gather for FSDP2: each gather sends blockwise-FP8 deltas instead of bf16 weights.

Every rank keeps ``R``, a persistent full-size copy of each FSDP group's gathered parameters (bf16 under
``train.precision: bf16``; the dtype FSDP gathers in). All ranks hold the same ``R``. One gather:

    rank r:  d_r = shard_r - R[r]  ->  (fp8 e4m3 d_r / s, one fp32 scale s = amax/448 per 256 elements)
    all:     all-gather the packed (fp8 bytes | scales) of every rank  ->  R += dequant(...)  ->  params = R

The first gather of each group (and, with ``reprime_every=K``, the first one after every K-th optimizer step)
primes ``R`` with a plain full-precision gather. The delta is taken against ``R``, not against the previous
true value, so each gather corrects the rounding of the one before: the error of ``R`` stays at one step's FP8
rounding of a (small) delta instead of accumulating over steps. Blocks are cut inside each rank's shard, so
every block is quantized and scaled by exactly one rank. Bytes per element: 1 + 4/256 instead of 2 (0.508x).

Hook: ``FSDPModule.set_custom_all_gather(comm)`` (public, torch >= 2.7). ``comm`` is duck-typed to the
``AllGather`` interface of ``torch.distributed.fsdp._fully_shard._fsdp_api`` (``allocate(size, *, dtype,
device)`` and ``__call__(output_tensor, input_tensor, group, async_op)``); we do not import that private class.
What we rely on beyond the signature: ``input_tensor`` is this rank's flat, padded slab of the group's
parameters in the gather dtype, ``output_tensor`` is ``world × slab`` in rank order (as
``all_gather_into_tensor`` fills it), and a group's slab layout is the same on every call. That holds in
torch 2.7-2.11's ``foreach_all_gather`` (``_fsdp_collectives.py``). Nothing else of FSDP is touched: the
backward reduce-scatter and the sharded fp32 master weights are unchanged.

Costs: ``R`` is one full copy of the trainable parameters in the gather dtype on every rank (FSDP otherwise
keeps only shards between gathers), and two passes over the group per gather (encode the shard, decode all
shards). The codec comes from the core's kernel registry (ops ``fp8_delta_encode`` / ``fp8_delta_apply``, chosen
by ``kernels.provider``): on CUDA the triton provider's fused kernels (``loongforge_kernels.fp8_delta``, which also
write the gathered parameters), bit-identical to the torch code here, which runs where no provider serves. The win is bandwidth: worth it where the link, not the GPU, bounds the all-gather (across
nodes).
GPU only: FP8 needs SM >= 8.9 (the gloo tests install :func:`delta_hook` on the CPU themselves).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

BLOCK = 256
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_TINY = float(torch.finfo(torch.float32).tiny)


# ----------------------------------------------------------------------------------------------- codec
def quantize_blockwise(x: torch.Tensor, *, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten ``x`` and quantize it to E4M3 in blocks of ``block`` elements (the last block zero-padded).

    Returns ``(q, scales)``: ``q`` float8_e4m3fn of ``ceil(n / block) * block`` elements, ``scales`` fp32 with
    one ``amax * fl32(1/448)`` per block. Per element, ``|dequant - x| <= max(|x| / 16, scale / 1024)``."""
    flat = x.reshape(-1).float()
    nb = max(1, math.ceil(flat.numel() / block))
    if flat.numel() != nb * block:
        flat = torch.nn.functional.pad(flat, (0, nb * block - flat.numel()))
    blocks = flat.view(nb, block)
    # NOTE: times the fp32 1/448 rather than ``div_(448)``: torch's CUDA div by a scalar multiplies by the
    # reciprocal and its CPU div divides, so only this gives the same bytes on both (and in the fused kernel).
    scales = torch.linalg.vector_norm(blocks, ord=math.inf, dim=1).mul_(1 / FP8_MAX).clamp_min_(_TINY)
    # NOTE: amax / scale may round to 448 + a few ulp; E4M3 rounds anything below 464 to 448, so no clamp.
    return (blocks / scales[:, None]).to(FP8).view(-1), scales


def dequantize_blockwise(q: torch.Tensor, scales: torch.Tensor, *, numel: int) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: fp32, the first ``numel`` elements."""
    nb = scales.numel()
    return (q.float().view(nb, -1) * scales[:, None]).view(-1)[:numel]


def _nblocks(numel: int) -> int:
    return max(1, math.ceil(numel / BLOCK))


def _encode_delta(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``x - ref`` (computed in fp32) packed as uint8: ``[fp8 values (nb*256 bytes) | fp32 scales (4*nb)]``."""
    n = x.numel()
    d = torch.empty(_nblocks(n) * BLOCK, dtype=torch.float32, device=x.device)
    d[n:].zero_()
    d[:n].copy_(x)
    d[:n].sub_(ref)
    q, scales = quantize_blockwise(d)
    payload = torch.empty(q.numel() + 4 * scales.numel(), dtype=torch.uint8, device=x.device)
    payload[:q.numel()].copy_(q.view(torch.uint8))
    payload[q.numel():].view(torch.float32).copy_(scales)
    return payload


def _apply_deltas(recon: torch.Tensor, gathered: torch.Tensor) -> None:
    """``recon`` (world, n) += the decoded deltas of ``gathered`` (world, payload bytes), row by row."""
    world, n = recon.shape
    nb = _nblocks(n)
    q = gathered[:, :nb * BLOCK].view(FP8)
    scales = gathered[:, nb * BLOCK:].view(torch.float32)
    dq = q.float().view(world, nb, BLOCK).mul_(scales[:, :, None]).view(world, nb * BLOCK)
    recon.add_(dq[:, :n])


# ----------------------------------------------------------------------------------------------- FSDP hook
@dataclass
class AllGatherStats:
    """Counters over every FSDP group, in bytes each rank receives (``world × per-rank payload``).

    ``bytes_baseline``: what FSDP's plain all-gather moves for the same calls (bf16 under bf16 training);
    ``bytes_sent``: what was moved (FP8 deltas + scales, plus the full-precision primes, ``bytes_prime``)."""

    calls: int = 0
    primes: int = 0
    bytes_baseline: int = 0
    bytes_sent: int = 0
    bytes_prime: int = 0

    @property
    def ratio(self) -> float:
        return self.bytes_sent / self.bytes_baseline if self.bytes_baseline else float("nan")

    @property
    def steady_ratio(self) -> float:
        """The ratio over delta gathers only (primes excluded)."""
        base = self.bytes_baseline - self.bytes_prime
        return (self.bytes_sent - self.bytes_prime) / base if base else float("nan")


class _GroupAllGather:
    """The all-gather of one FSDP group (one ``fully_shard`` module), with its reconstruction ``recon``."""

    def __init__(self, owner: AllGatherHook):
        self.owner = owner
        self.recon: torch.Tensor | None = None  # (world * slab,), the gathered layout
        self.prime = True

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        # NOTE: always synchronous on the stream FSDP put us on (its all-gather stream in forward / prefetch);
        # returning no Work makes FSDP wait on the event it records after this call.
        with self.owner.timed(input_tensor.device):
            self._gather(output_tensor, input_tensor, group)
        return None

    def _gather(self, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
        st = self.owner.stats
        base = out.numel() * out.element_size()
        st.calls += 1
        st.bytes_baseline += base
        fresh = self.recon is None or self.recon.shape != out.shape or self.recon.dtype != out.dtype
        if not self.owner.quantize or self.prime or fresh:
            dist.all_gather_into_tensor(out, inp, group=group)
            st.bytes_sent += base
            if self.owner.quantize:
                if fresh:
                    self.recon = out.clone()
                else:
                    self.recon.copy_(out)
                self.prime = False
                st.primes += 1
                st.bytes_prime += base
            return
        world, rank = group.size(), group.rank()
        rows = self.recon.view(world, -1)
        # NOTE: ``inp`` is a view into ``out`` (FSDP copies the shard in at this rank's offset): encode it before
        # ``out`` is overwritten.
        encode, apply = self.owner.encode, self.owner.apply
        payload = _encode_delta(inp, rows[rank]) if encode is None else encode(inp, rows[rank])
        gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=inp.device)
        dist.all_gather_into_tensor(gathered, payload, group=group)
        if apply is None:
            _apply_deltas(rows, gathered.view(world, -1))
            out.copy_(self.recon)
        else:  # one pass: updates the reconstruction and writes the gathered parameters
            apply(rows, gathered.view(world, -1), out=out.view(world, -1))
        st.bytes_sent += gathered.numel()


@dataclass
class AllGatherHook:
    """The custom all-gathers installed on a model's FSDP modules, their counters and timings.

    Call :meth:`step` once per optimizer step (it drives ``reprime_every``)."""

    quantize: bool
    reprime_every: int = 0
    # the codec's two passes (``kernels.choose``: fp8_delta_encode / fp8_delta_apply); None: the torch code here
    encode: Callable[..., torch.Tensor] | None = None
    apply: Callable[..., None] | None = None
    stats: AllGatherStats = field(default_factory=AllGatherStats)
    groups: list[_GroupAllGather] = field(default_factory=list)
    timing: bool = False
    steps: int = 0
    _events: list = field(default_factory=list)
    _seconds: float = 0.0

    def step(self) -> None:
        self.steps += 1
        if self.quantize and self.reprime_every and self.steps % self.reprime_every == 0:
            self.reprime()

    def reprime(self) -> None:
        """Make every group's next gather a full-precision one that resets its reconstruction (e.g. after
        parameters were loaded or edited outside the optimizer)."""
        for g in self.groups:
            g.prime = True

    @contextlib.contextmanager
    def timed(self, device: torch.device) -> Iterator[None]:
        if not self.timing:
            yield
            return
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
            return
        t0 = time.perf_counter()
        yield
        self._seconds += time.perf_counter() - t0

    def take_time_ms(self) -> float:
        """Milliseconds spent inside the all-gathers (encode + collective + decode) since the last call; on CUDA
        measured by events on the stream FSDP runs them on (synchronizes)."""
        if self._events:
            torch.cuda.synchronize()
        ms = sum(s.elapsed_time(e) for s, e in self._events) + self._seconds * 1e3
        self._events, self._seconds = [], 0.0
        return ms


def fp8_unsupported_reason(device: torch.device) -> str | None:
    """Why delta-FP8 gathers cannot run on ``device`` (None when they can): CUDA with SM >= 8.9 only."""
    if device.type != "cuda":
        return f"needs a CUDA GPU with SM >= 8.9 (FP8); this run is on {device.type}"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return f"needs SM >= 8.9 (FP8); {torch.cuda.get_device_name(device)} is SM {cap[0]}.{cap[1]}"
    return None


def _install(model: nn.Module, hook: AllGatherHook) -> AllGatherHook:
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            g = _GroupAllGather(hook)
            m.set_custom_all_gather(g)
            hook.groups.append(g)
    if not hook.groups:
        raise ValueError("no FSDP2 (fully_shard) module in the model: delta-FP8 all-gather needs fsdp2 / hsdp")
    return hook


def enable_delta_fp8_allgather(model: nn.Module, *, reprime_every: int = 0, timing: bool = False,
                               kernels: str = "auto", accelerator: Any = None) -> AllGatherHook:
    """Install delta-FP8 parameter all-gathers on every ``fully_shard`` module of ``model`` (after FSDP2 was
    applied). ``reprime_every=K``: a full-precision gather after every K-th :meth:`AllGatherHook.step`
    (0: only the first). ``timing`` records the time spent in the gathers (:meth:`AllGatherHook.take_time_ms`).
    ``kernels``: the recipe's ``kernels.provider``, which picks the codec (``loongforge_embodied.kernels``)."""
    if reprime_every < 0:
        raise ValueError(f"reprime_every must be >= 0 (got {reprime_every})")
    device = next(model.parameters()).device
    reason = fp8_unsupported_reason(device)
    if reason:
        raise RuntimeError(f"delta-FP8 all-gather {reason}")
    return _install(model, delta_hook(device_type=device.type, reprime_every=reprime_every, timing=timing,
                                      kernels=kernels, accelerator=accelerator))


def delta_hook(*, device_type: str, reprime_every: int = 0, timing: bool = False, kernels: str = "auto",
               accelerator: Any = None) -> AllGatherHook:
    """The quantizing hook with its codec chosen through the core's kernel registry (not yet installed)."""
    from loongforge_embodied.kernels import choose

    encode = choose("fp8_delta_encode", provider=kernels, device_type=device_type, accelerator=accelerator).impl
    apply = choose("fp8_delta_apply", provider=kernels, device_type=device_type, accelerator=accelerator).impl
    return AllGatherHook(quantize=True, reprime_every=reprime_every, timing=timing, encode=encode, apply=apply)


def meter_allgather(model: nn.Module, *, timing: bool = False) -> AllGatherHook:
    """FSDP's plain all-gather, counted and timed the same way (the baseline of the benchmark and tests)."""
    return _install(model, AllGatherHook(quantize=False, timing=timing))

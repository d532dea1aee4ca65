"""AdamW's update over a list of tensors in one Triton launch per parameter dtype (one gradient dtype each).

``adamw_step_(params, grads, exp_avgs, exp_avg_sqs, steps, ...)`` is the math of torch's fused AdamW
(``torch._fused_adamw_``), per element in fp32, for steps that already count this update:

    g = grad / grad_scale                    (grad_scale: an optional fp32 device scalar, e.g. 1 / clip coef)
    p = p - lr * weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - (lr / (1 - beta1 ** step)) * m / (sqrt(v) / sqrt(1 - beta2 ** step) + eps)

Why our own: torch's fused kernel moves pi05's optimizer bytes at ~2.9 TB/s of the H200's 4.8, and with a
``grad_scale`` it also writes every unscaled gradient back (an output nobody reads: the trainer drops the
gradients after the step). Here each program streams one block of one tensor — its addresses come from a
per-launch table of (param, grad, exp_avg, exp_avg_sq, step, numel) rows (element offsets from one typed base
pointer per dtype, so the compiler knows the alignment and vectorises), so the tensors need not be one flat
buffer — and the gradient is read only: 14 bytes per bf16 element instead of 16.

``AdamWPlan`` holds what stays fixed between steps (the parameters', moments' and steps' offsets, which
(tensor, block) each program takes); only the gradients' column is rebuilt every call (they are new tensors
every step), and the table reaches the device from pinned memory without a host sync. The same table serves
``grad_sumsq`` (the clip's norm), and row-sparse tables (embeddings) skip the blocks no step has touched. On CPU
tensors the kernels run under Triton's interpreter (tests); ``adamw_step_ref`` is the plain-torch statement of
the same math.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from loongforge_kernels._dispatch import KernelUnavailableError, jit, resolve, tl
from loongforge_kernels.fp8_delta import _f32, _round_to

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Elements and warps per program: on the H200 8192 x 16 moves pi05's optimizer bytes at 3.66 TB/s, 2048 x 4 at
# 3.55, 4096 x 8 at 2.85 (benchmarks/results/adamw_pi05_h200_2026-12-01.md). The interpreter pays per program.
BLOCK = {"cuda": 8192, "cpu": 1024}
NUM_WARPS = 16
# A pointer-table row: the element offsets of param, grad, exp_avg, exp_avg_sq (from the first param's / grad's
# address) and of the step (an fp32 scalar, from the first step's), then numel.


@jit
def _update(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, scale, lr, beta1, beta2, eps, weight_decay, step_size,
            bias2_sqrt, P_DTYPE: tl.constexpr, HAS_SCALE: tl.constexpr, HW_CVT: tl.constexpr,
            MASKED: tl.constexpr):
    if MASKED:
        g = _f32(tl.load(g_ptr + offs, mask=mask, other=0.0))
        p = _f32(tl.load(p_ptr + offs, mask=mask, other=0.0))
        m = _f32(tl.load(m_ptr + offs, mask=mask, other=0.0))
        v = _f32(tl.load(v_ptr + offs, mask=mask, other=0.0))
    else:
        g = _f32(tl.load(g_ptr + offs))
        p = _f32(tl.load(p_ptr + offs))
        m = _f32(tl.load(m_ptr + offs))
        v = _f32(tl.load(v_ptr + offs))
    if HAS_SCALE:
        g = g / scale
    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bias2_sqrt + eps)
    if MASKED:
        tl.store(p_ptr + offs, _round_to(p, P_DTYPE, HW_CVT), mask=mask)
        tl.store(m_ptr + offs, _round_to(m, P_DTYPE, HW_CVT), mask=mask)
        tl.store(v_ptr + offs, _round_to(v, P_DTYPE, HW_CVT), mask=mask)
    else:
        tl.store(p_ptr + offs, _round_to(p, P_DTYPE, HW_CVT))
        tl.store(m_ptr + offs, _round_to(m, P_DTYPE, HW_CVT))
        tl.store(v_ptr + offs, _round_to(v, P_DTYPE, HW_CVT))


@jit
def _decay(p_ptr, offs, mask, lr, weight_decay, P_DTYPE: tl.constexpr, HW_CVT: tl.constexpr, MASKED: tl.constexpr):
    """The update of a block whose gradient and moments are all zero: ``p - lr * weight_decay * p`` (the Adam
    term is ``-step_size * 0 / eps``, and the moments stay 0), bit for bit what ``_update`` would write."""
    if MASKED:
        p = _f32(tl.load(p_ptr + offs, mask=mask, other=0.0))
        tl.store(p_ptr + offs, _round_to(p - lr * weight_decay * p, P_DTYPE, HW_CVT), mask=mask)
    else:
        p = _f32(tl.load(p_ptr + offs))
        tl.store(p_ptr + offs, _round_to(p - lr * weight_decay * p, P_DTYPE, HW_CVT))


@jit
def _adamw_kernel(
    WHICH,
    START,
    TABLE,
    P_BASE,
    G_BASE,
    S_BASE,
    GRAD_SCALE,
    ACTIVE,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    log2_beta1,
    log2_beta2,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_SPARSE: tl.constexpr,
    DECAY_NOOP: tl.constexpr,
    HW_CVT: tl.constexpr,
    P_ALIGN: tl.constexpr,
    G_ALIGN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program i: block START[i] of tensor WHICH[i] (a TABLE row of element offsets from P_BASE / G_BASE /
    S_BASE); full blocks take the unmasked (vectorised) path. With HAS_SPARSE, a block whose ACTIVE[i] is 0
    (gradient and moments known to be zero) only decays its parameters: 4 of the 14 bytes per bf16 element, or
    none with DECAY_NOOP (the decay rounds back to every finite value of P_DTYPE: ``decay_is_noop``)."""
    pid = tl.program_id(0)
    row = TABLE + tl.load(WHICH + pid).to(tl.int64) * 6
    # NOTE: every address is 16-byte aligned (checked on the host), so each offset is a multiple of 16 bytes in
    # elements (P_ALIGN / G_ALIGN): with the hint the compiler vectorises the loads and stores, which it does not
    # for an address cast from an integer. The hint must stay here: inside a helper function it is lost.
    p_ptr = P_BASE + tl.multiple_of(tl.load(row), P_ALIGN)
    g_ptr = G_BASE + tl.multiple_of(tl.load(row + 1), G_ALIGN)
    m_ptr = P_BASE + tl.multiple_of(tl.load(row + 2), P_ALIGN)
    v_ptr = P_BASE + tl.multiple_of(tl.load(row + 3), P_ALIGN)
    step = tl.load(S_BASE + tl.load(row + 4))
    n = tl.load(row + 5)
    base = tl.load(START + pid).to(tl.int64) * BLOCK
    offs = base + tl.arange(0, BLOCK)
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(GRAD_SCALE)
    step_size = lr / (1.0 - tl.exp2(step * log2_beta1))
    bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    active = True
    if HAS_SPARSE:
        active = tl.load(ACTIVE + pid) != 0
    if active:
        if base + BLOCK <= n:
            _update(p_ptr, g_ptr, m_ptr, v_ptr, offs, None, scale, lr, beta1, beta2, eps, weight_decay, step_size,
                    bias2_sqrt, P_DTYPE, HAS_SCALE, HW_CVT, False)
        else:
            _update(p_ptr, g_ptr, m_ptr, v_ptr, offs, offs < n, scale, lr, beta1, beta2, eps, weight_decay,
                    step_size, bias2_sqrt, P_DTYPE, HAS_SCALE, HW_CVT, True)
    elif not DECAY_NOOP:
        if base + BLOCK <= n:
            _decay(p_ptr, offs, None, lr, weight_decay, P_DTYPE, HW_CVT, False)
        else:
            _decay(p_ptr, offs, offs < n, lr, weight_decay, P_DTYPE, HW_CVT, True)


# |lr * weight_decay| at most this: ``p - lr * weight_decay * p`` (in fp32) rounds back to p for every finite p of the
# dtype. The largest relative step that still rounds back is half the gap below a power of two: 2^-9 in bf16 (8
# significant bits), 2^-12 in fp16 (11); the bounds leave a factor 2 for the fp32 arithmetic. fp32: never.
_DECAY_NOOP_BELOW = {torch.bfloat16: 2.0 ** -10, torch.float16: 2.0 ** -13}


def decay_is_noop(dtype: torch.dtype, lr: float, weight_decay: float) -> bool:
    """Whether AdamW's decay-only update (zero gradient and moments) leaves every finite ``dtype`` value as it is,
    so a row-sparse table's untouched blocks need not be read at all (pi05: lr 2.5e-5 x weight decay 0.01, far
    below bf16's 2^-10; checked over every bf16 and fp16 value, powers of two, subnormals and negatives included).
    Infinite parameters would become NaN under the decay and stay infinite here, and a -0.0 stays -0.0 where the
    decay writes +0.0 (an equal value)."""
    return abs(lr * weight_decay) <= _DECAY_NOOP_BELOW.get(dtype, 0.0)


@jit
def _sumsq_kernel(WHICH, START, TABLE, G_BASE, ACTIVE, OUT, HAS_SPARSE: tl.constexpr, G_ALIGN: tl.constexpr,
                  BLOCK: tl.constexpr):
    """OUT[i] = the fp32 sum of squares of program i's gradient block (0 for an inactive block)."""
    pid = tl.program_id(0)
    row = TABLE + tl.load(WHICH + pid).to(tl.int64) * 6
    g_ptr = G_BASE + tl.multiple_of(tl.load(row + 1), G_ALIGN)  # NOTE: the hint must stay here (see above)
    n = tl.load(row + 5)
    base = tl.load(START + pid).to(tl.int64) * BLOCK
    offs = base + tl.arange(0, BLOCK)
    active = True
    if HAS_SPARSE:
        active = tl.load(ACTIVE + pid) != 0
    total = 0.0
    if active:
        if base + BLOCK <= n:
            g = _f32(tl.load(g_ptr + offs))
        else:
            g = _f32(tl.load(g_ptr + offs, mask=offs < n, other=0.0))
        total = tl.sum(g * g, axis=0)
    tl.store(OUT + pid, total)


_TL = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _block_table(counts: list[int], first: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tensor index, block index within it) of every program, for tensors of ``counts`` blocks starting at
    program ``first``."""
    n = torch.tensor(counts, dtype=torch.int64)
    which = torch.repeat_interleave(torch.arange(len(counts)), n)
    start = torch.arange(len(which)) - torch.repeat_interleave(torch.tensor(first, dtype=torch.int64), n)
    return which.to(torch.int32).to(device), start.to(torch.int32).to(device)


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        # NOTE: from pinned memory the copy is queued without waiting for the stream; the caching host
        # allocator keeps the pinned block until the copy is done.
        return table.pin_memory().to(device, non_blocking=True)
    return table


class _Launch:
    """One dtype's tensors: the static table (params, moments, steps, sizes), the block table, and per program
    whether its block is active (row-sparse tensors: touched rows only; every other block always)."""

    def __init__(self, idx: list[int], params, exp_avgs, exp_avg_sqs, steps, sparse, block: int):
        self.idx = idx
        self.p0, self.s0 = params[idx[0]], steps[idx[0]]
        size, pb, sb = self.p0.element_size(), self.p0.data_ptr(), self.s0.data_ptr()
        self.table = torch.tensor(
            [[(params[i].data_ptr() - pb) // size, 0, (exp_avgs[i].data_ptr() - pb) // size,
              (exp_avg_sqs[i].data_ptr() - pb) // size, (steps[i].data_ptr() - sb) // 4, params[i].numel()]
             for i in idx], dtype=torch.int64)
        numels = [params[i].numel() for i in idx]
        self.numels = numels
        counts = [max(1, -(-n // block)) for n in numels]
        self.first = [0, *itertools.accumulate(counts)][:-1]  # each tensor's first program
        self.blocks = _block_table(counts, self.first, self.p0.device)
        self.sparse = any(sparse[i] for i in idx)
        self.active = None
        if self.sparse:
            self.active = torch.ones(sum(counts), dtype=torch.uint8, device=self.p0.device)
            for j, i in enumerate(idx):
                if sparse[i]:
                    # NOTE: a block is inactive only while its moments are all zero (a fresh state, or rows never
                    # touched since): then, with a zero gradient, AdamW only decays it.
                    nz = (exp_avgs[i] != 0) | (exp_avg_sqs[i] != 0)
                    nz = torch.nn.functional.pad(nz.flatten(), (0, counts[j] * block - numels[j]))
                    self.active[self.first[j]:self.first[j] + counts[j]] = nz.view(counts[j], block).any(1)


class AdamWPlan:
    """The part of an AdamW step that is the same every step — parameters, moments, step counters — checked once
    and laid out as kernel tables once; ``check(grads)`` checks only the gradients (new tensors every step) and
    uploads their table, ``launch`` updates, ``grad_sumsq`` reads the same table for the clip's norm. An optimizer
    keeps one per parameter list (host time: pi05's 800+ tensors cost ~15 ms a step when everything is
    re-checked; the kernel itself takes ~14).

    ``row_sparse[i]``: tensor i is a 2-D table whose gradient is zero outside the rows given to ``mark_rows``
    for this step (an embedding's): blocks never marked (and whose moments are zero) only decay, and the norm
    skips them — exact for a finite ``grad_scale`` and ``eps > 0``: AdamW on a zero gradient with zero moments is
    ``p - lr * weight_decay * p``."""

    def __init__(self, params: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                 exp_avg_sqs: Sequence[torch.Tensor], steps: Sequence[torch.Tensor],
                 row_sparse: Sequence[bool] | None = None):
        n = len(params)
        if not (len(exp_avgs) == len(exp_avg_sqs) == len(steps) == n) or n == 0:
            raise ValueError("AdamWPlan: params, exp_avgs, exp_avg_sqs and steps must be non-empty, one entry each")
        sparse = list(row_sparse) if row_sparse is not None else [False] * n
        if len(sparse) != n:
            raise ValueError(f"AdamWPlan: row_sparse has {len(sparse)} entries for {n} tensors")
        self.device = params[0].device
        groups: dict[torch.dtype, list[int]] = {}
        for i, (p, m, v, s) in enumerate(zip(params, exp_avgs, exp_avg_sqs, steps, strict=True)):
            if p.dtype not in DTYPES or m.dtype != p.dtype or v.dtype != p.dtype:
                raise KernelUnavailableError(
                    f"adamw: tensor {i}: param {p.dtype}, moments {m.dtype} / {v.dtype}; the Triton kernel takes "
                    "bf16 / fp16 / fp32 with moments in the parameter's dtype")
            if any(t.device != self.device for t in (p, m, v, s)) or s.dtype != torch.float32 or s.numel() != 1:
                raise KernelUnavailableError(f"adamw: tensor {i} is not on {self.device} or its step is not an fp32 "
                                             "scalar tensor there")
            if not (p.is_contiguous() and m.is_contiguous() and v.is_contiguous()):
                raise KernelUnavailableError(f"adamw: tensor {i} is not contiguous")
            if any(t.data_ptr() % 16 for t in (p, m, v)):
                raise KernelUnavailableError(f"adamw: tensor {i} does not start at a 16-byte aligned address")
            if sparse[i] and p.dim() != 2:
                raise ValueError(f"AdamWPlan: row-sparse tensor {i} must be 2-D (rows x columns), got {p.dim()}-D")
            groups.setdefault(p.dtype, []).append(i)
        self.n = n
        self.cuda = self.device.type == "cuda"
        block = BLOCK["cuda" if self.cuda else "cpu"]
        self.block, self.num_warps = block, NUM_WARPS
        self.launches = [_Launch(idx, params, exp_avgs, exp_avg_sqs, steps, sparse, block) for idx in groups.values()]
        self._where = {i: (launch, j) for launch in self.launches for j, i in enumerate(launch.idx)}
        self._cols = {i: params[i].shape[1] for i in range(n) if sparse[i]}

    def is_row_sparse(self, i: int) -> bool:
        return i in self._cols

    def mark_rows(self, i: int, rows: torch.Tensor) -> None:
        """Rows of row-sparse tensor ``i`` that may have a nonzero gradient this step (a device tensor of row
        indices, any shape, repeats allowed): their blocks become active for good. No host sync."""
        if i not in self._cols:
            raise ValueError(f"AdamWPlan.mark_rows: tensor {i} was not declared row-sparse")
        launch, j = self._where[i]
        cols, block = self._cols[i], self.block
        start = rows.reshape(-1).to(device=self.device, dtype=torch.int64) * cols
        first, last = start // block, (start + cols - 1) // block
        span = torch.arange(-(-cols // block) + 1, device=self.device)
        blocks = torch.minimum(first[:, None] + span[None, :], last[:, None])
        # NOTE: index_fill_ takes the 1 as a kernel argument; ``active[idx] = 1`` copies it from the host and
        # synchronises (seen on the H200 with benchmarks/tools/find_syncs.py)
        launch.active.index_fill_(0, launch.first[j] + blocks.reshape(-1), 1)

    def check(self, grads: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per launch (its first gradient, the pointer table on the device); raises ``KernelUnavailableError``
        before anything is written when a gradient cannot be read by the kernel."""
        if len(grads) != self.n:
            raise ValueError(f"adamw: {len(grads)} gradients for {self.n} parameters")
        cols = []
        for launch in self.launches:
            gs = [grads[i] for i in launch.idx]
            g0 = gs[0]
            if g0.dtype not in DTYPES or any(g.dtype != g0.dtype or g.layout != torch.strided or not g.is_contiguous()
                                             for g in gs):
                raise KernelUnavailableError("adamw: gradients must be dense, contiguous and of one dtype (bf16 / "
                                             "fp16 / fp32) per parameter dtype")
            if [g.numel() for g in gs] != launch.numels:  # NOTE: the kernel reads as many elements as the param has
                raise KernelUnavailableError("adamw: a gradient's size differs from its parameter's")
            ptrs = torch.tensor([g.data_ptr() for g in gs], dtype=torch.int64)
            if bool((ptrs % 16).any()) or g0.device != self.device:
                raise KernelUnavailableError(f"adamw: a gradient is not on {self.device} at a 16-byte aligned address")
            cols.append((g0, (ptrs - ptrs[0]) // g0.element_size()))
        out = []
        for launch, (g0, col) in zip(self.launches, cols, strict=True):
            table = launch.table.clone()
            table[:, 1] = col
            out.append((g0, _to_device(table, self.device)))
        return out

    def step(self, grads: Sequence[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
             weight_decay: float, grad_scale: torch.Tensor | None = None) -> None:
        self.check_scale(grad_scale)
        self.launch(self.check(grads), lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                    grad_scale=grad_scale)

    def check_scale(self, grad_scale: torch.Tensor | None) -> None:
        if grad_scale is not None and (grad_scale.dtype != torch.float32 or grad_scale.device != self.device):
            raise KernelUnavailableError("adamw: grad_scale must be an fp32 tensor on the parameters' device")

    def launch(self, checked: list[tuple[torch.Tensor, torch.Tensor]], *, lr: float, beta1: float, beta2: float,
               eps: float, weight_decay: float, grad_scale: torch.Tensor | None = None) -> None:
        """The kernels, for gradients ``check`` accepted (its result)."""
        log2 = [math.log2(b) if b > 0 else -math.inf for b in (beta1, beta2)]
        for launch, (g0, table) in zip(self.launches, checked, strict=True):
            which, start = launch.blocks
            _adamw_kernel[(which.numel(),)](
                which, start, table, launch.p0, g0, launch.s0,
                grad_scale if grad_scale is not None else launch.s0,  # NOTE: unread without HAS_SCALE
                launch.active if launch.sparse else which,  # NOTE: unread without HAS_SPARSE
                float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), log2[0], log2[1],
                P_DTYPE=getattr(tl, _TL[launch.p0.dtype]), G_DTYPE=getattr(tl, _TL[g0.dtype]),
                HAS_SCALE=grad_scale is not None, HAS_SPARSE=launch.sparse,
                DECAY_NOOP=launch.sparse and decay_is_noop(launch.p0.dtype, lr, weight_decay), HW_CVT=self.cuda,
                P_ALIGN=16 // launch.p0.element_size(), G_ALIGN=16 // g0.element_size(), BLOCK=self.block,
                num_warps=self.num_warps,
            )

    def grad_sumsq(self, checked: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The fp32 sum of squares of all the gradients ``check`` accepted (a device scalar: no host sync)."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for launch, (g0, table) in zip(self.launches, checked, strict=True):
            which, start = launch.blocks
            part = torch.empty(which.numel(), dtype=torch.float32, device=self.device)
            _sumsq_kernel[(which.numel(),)](
                which, start, table, g0, launch.active if launch.sparse else which, part,
                HAS_SPARSE=launch.sparse, G_ALIGN=16 // g0.element_size(), BLOCK=self.block,
                num_warps=self.num_warps,
            )
            total += part.sum()
        return total


def adamw_step_ref(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """The same update in plain torch (fp32 math per tensor, rounded once to each tensor's dtype)."""
    for p, g, m, v, s in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
        g32 = g.float() / grad_scale.float() if grad_scale is not None else g.float()
        p32, m32, v32 = p.float(), m.float(), v.float()
        step = float(s)
        p32 = p32 - lr * weight_decay * p32
        m32 = beta1 * m32 + (1 - beta1) * g32
        v32 = beta2 * v32 + (1 - beta2) * g32 * g32
        p32 = p32 - (lr / (1 - beta1**step)) * m32 / (v32.sqrt() / math.sqrt(1 - beta2**step) + eps)
        p.copy_(p32)
        m.copy_(m32)
        v.copy_(v32)


def adamw_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: torch.Tensor | None = None,
    impl: str | None = None,
) -> None:
    """Update ``params``, ``exp_avgs``, ``exp_avg_sqs`` in place (see the module docstring); ``steps`` are fp32
    scalar tensors that already count this update (torch's AdamW state). Tensors must be contiguous, on one
    device, moments in their parameter's dtype (bf16 / fp16 / fp32); ``impl``: ``auto`` (None), ``torch`` or ``triton``."""
    if not params:
        return
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(steps) == n):
        raise ValueError("adamw_step_: params, grads, exp_avgs, exp_avg_sqs and steps must have one entry each")
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale)
    if resolve(impl, params[0]) == "torch":
        adamw_step_ref(params, grads, exp_avgs, exp_avg_sqs, steps, **kw)
        return
    AdamWPlan(params, exp_avgs, exp_avg_sqs, steps).step(grads, **kw)

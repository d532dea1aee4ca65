"""``KernelAdamW`` (our Triton AdamW step behind torch's AdamW state) trains like torch's fused AdamW: groups,
grad scale (the clip), a parameter without a gradient, resume from its state dict, and the torch fallback. The
kernel runs on CPU tensors through Triton's interpreter, so the checks run in a subprocess with
``TRITON_INTERPRET=1`` (it must be set before triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import copy, torch
from loongforge_embodied.optim import KernelAdamW

def params(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in ((33, 17), (5000,), (3,))]

def groups(ps):
    return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]

def run(cls, ps, steps, opt=None, seed=7, start=0):
    opt = opt or cls(groups(ps), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    g = torch.Generator().manual_seed(seed)
    for i in range(start, steps):
        grads = [torch.randn(p.shape, generator=g).to(p.dtype) for p in ps]
        for j, (p, gr) in enumerate(zip(ps, grads)):
            p.grad = None if (i == 1 and j == 1) else gr  # NOTE: no gradient at step 1: no update, no step count
        opt.grad_scale = torch.tensor(1.0 + i / 3)
        opt.step()
        opt.grad_scale = None
    return opt

for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 2 ** -7)):
    ours, ref = params(dtype, 0), params(dtype, 0)
    o = run(KernelAdamW, ours, 4)
    r = run(torch.optim.AdamW, ref, 4)
    assert o._plans, "the kernel path did not run"
    for a, b in zip(ours, ref):
        assert torch.allclose(a.float(), b.float(), rtol=tol, atol=1e-6), (dtype, (a.float() - b.float()).abs().max())
    assert float(o.state[ours[1]]["step"]) == float(r.state[ref[1]]["step"]) == 3.0
    assert {k: v.dtype for k, v in o.state[ours[0]].items()} == {k: v.dtype for k, v in r.state[ref[0]].items()}
    # resume: a new optimizer from the state dict continues like the uninterrupted run
    sd = copy.deepcopy(o.state_dict())
    resumed = params(dtype, 0)
    with torch.no_grad():
        for a, b in zip(resumed, ours):
            a.copy_(b)
    o2 = KernelAdamW(groups(resumed), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    o2.load_state_dict(sd)
    run(KernelAdamW, resumed, 6, opt=o2, seed=11, start=4)
    run(KernelAdamW, ours, 6, opt=o, seed=11, start=4)
    for a, b in zip(resumed, ours):
        assert torch.equal(a, b), dtype
print("kernel ok")

# row-sparse token table + grad_norm: bitwise the dense kernel path, and torch's norm to rounding
def model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(3000, 40), torch.nn.Linear(40, 3))

a, b = model(0), model(0)
oa = KernelAdamW(a.parameters(), lr=1e-2, weight_decay=0.1, fused=True, row_sparse=[a[0].weight])
ob = KernelAdamW(b.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
gen = torch.Generator().manual_seed(5)
for i in range(4):
    ids = torch.randint(0, 50 if i < 3 else 3000, (8, 6), generator=gen)  # NOTE: the last step anywhere
    for m, o in ((a, oa), (b, ob)):
        m(ids).square().mean().backward()
        if o is oa:
            o.mark_rows(m[0].weight, ids)
        params = list(m.parameters())
        norm = o.grad_norm(params)
        ref = torch.nn.utils.get_total_norm([p.grad for p in params])
        assert norm is not None and torch.allclose(norm, ref, rtol=1e-5), (norm, ref)
        o.grad_scale = (norm / 0.05).clamp(min=1.0)
        o.step()
        o.zero_grad()
for x, y in zip(a.parameters(), b.parameters()):
    assert torch.equal(x, y)
plan = oa._plans[0][1]
assert 0 < int(plan.launches[0].active.sum()) < plan.launches[0].active.numel()
print("row sparse ok")

# review findings: a fallback step (a closure: torch's step) on rows the plan never marked, and a parameter whose
# storage moved under the cached plan, leave the row-sparse run bit for bit the dense one (the same fallback); a
# copied optimizer still steps
a, b = model(1), model(1)
oa = KernelAdamW(a.parameters(), lr=1e-2, weight_decay=0.1, fused=True, row_sparse=[a[0].weight])
ob = KernelAdamW(b.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
for i in range(5):
    ids = torch.arange(10) + 100 * i  # NOTE: new rows every step
    for m, o in ((a, oa), (b, ob)):
        m(ids[None]).square().mean().backward()
        if o is oa and i != 1:  # NOTE: step 1 falls back (a closure) and marks nothing
            o.mark_rows(m[0].weight, ids)
        if i == 3:
            m[1].weight.data = m[1].weight.data.clone()  # NOTE: storage moved under the cached plan
        o.step((lambda: None) if i == 1 else None)
        o.zero_grad()
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y), (i, (x - y).abs().max())
copied = copy.deepcopy(oa)
a[0].weight.grad = torch.ones_like(a[0].weight)
copied.step()
print("fallback ok")
"""

FALLBACK = r"""
import torch
from loongforge.errors import PluginError
from loongforge_embodied.optim import KernelAdamW
from unittest import mock

# a tensor the kernel cannot take (fp64): torch's own step, the refusal remembered
p = torch.nn.Parameter(torch.ones(8, dtype=torch.float64)); q = torch.nn.Parameter(torch.ones(8, dtype=torch.float64))
o = KernelAdamW([p], lr=0.1, fused=True); r = torch.optim.AdamW([q], lr=0.1, fused=True)
for _ in range(2):
    p.grad = torch.full((8,), 0.5, dtype=torch.float64); q.grad = p.grad.clone(); o.step(); r.step()
assert all(plan is None for _, plan in o._plans.values()) and torch.equal(p, q)
# no provider serving adamw_plan (here: the registry refuses it) under auto: torch's own step, no plan made
p = torch.nn.Parameter(torch.ones(8)); q = torch.nn.Parameter(torch.ones(8))
o = KernelAdamW([p], lr=0.1, fused=True); r = torch.optim.AdamW([q], lr=0.1, fused=True)
with mock.patch("loongforge.kernels.select_op", side_effect=PluginError("no provider serves op 'adamw_plan'")):
    for _ in range(2):
        p.grad = torch.full((8,), 0.5); q.grad = p.grad.clone(); o.step(); r.step()
assert not o._plans and torch.equal(p, q)
# an explicit provider that cannot serve it raises (the registry's one rule)
o = KernelAdamW([p], lr=0.1, fused=True, kernels="torch")
p.grad = torch.full((8,), 0.5)
try:
    o.step()
    raise SystemExit("an explicit provider without adamw_plan did not raise")
except PluginError as exc:
    assert "adamw_plan" in str(exc), exc
print("fallback ok")
"""


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_kernel_adamw_trains_and_resumes_like_torch_adamw():
    r = _run(SCRIPT, TRITON_INTERPRET="1")
    assert r.returncode == 0 and "kernel ok" in r.stdout and "row sparse ok" in r.stdout and "fallback ok" in r.stdout, \
        r.stdout[-2000:] + r.stderr[-4000:]


def test_kernel_adamw_falls_back_to_torch():
    """Any tensor the kernel cannot take, and ``auto`` with no provider serving ``adamw_plan``, run torch's own
    step; an explicit provider that cannot serve it raises."""
    r = _run(FALLBACK, TRITON_INTERPRET="1")
    assert r.returncode == 0 and "fallback ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]

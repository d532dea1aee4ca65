"""The multi-tensor AdamW kernel vs its torch statement and vs torch's own AdamW (CPU: Triton's interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loongforge_kernels import KernelUnavailableError, _dispatch
from loongforge_kernels.adamw import AdamWPlan, adamw_step_, adamw_step_ref

HP = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
SHAPES = [(33, 17), (1,), (2049,), (3, 1024)]  # ragged sizes: blocks that end inside and exactly at a tensor


def _state(dtype, gen):
    ps = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
    gs = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
    ms = [(torch.randn(s, generator=gen) * 0.1).to(dtype) for s in SHAPES]
    vs = [(torch.rand(s, generator=gen) * 0.01).to(dtype) for s in SHAPES]
    ss = [torch.tensor(float(i + 1)) for i in range(len(SHAPES))]  # a different step per tensor
    return ps, gs, ms, vs, ss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaled", [False, True])
def test_kernel_matches_its_torch_statement(triton_cpu, dtype, scaled):
    gen = torch.Generator().manual_seed(0)
    a = _state(dtype, gen)
    b = [[t.clone() for t in part] for part in a]
    grads_before = [g.clone() for g in a[1]]
    scale = torch.tensor(2.5) if scaled else None
    adamw_step_(*a, **HP, grad_scale=scale, impl="triton")
    adamw_step_ref(*b, **HP, grad_scale=scale)
    for part in (0, 2, 3):  # params, exp_avgs, exp_avg_sqs
        for x, y in zip(a[part], b[part], strict=True):
            # NOTE: fp32 math both ways; the kernel's bias corrections go through exp2, torch's through pow
            torch.testing.assert_close(x, y, atol=1e-7, rtol=1e-6) if dtype == torch.float32 else \
                torch.testing.assert_close(x.float(), y.float(), atol=0, rtol=2**-7)
    for g, before in zip(a[1], grads_before, strict=True):
        assert torch.equal(g, before)  # gradients are read only


def test_kernel_trains_like_torch_adamw(triton_cpu):
    """Several steps, two groups (decayed / not), clip through ``grad_scale``: within fp32 rounding of torch's
    fused AdamW, whose state layout the kernel's caller keeps."""
    gen = torch.Generator().manual_seed(1)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt = torch.optim.AdamW([{"params": qs[:2]}, {"params": qs[2:], "weight_decay": 0.0}], lr=HP["lr"],
                            betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=HP["weight_decay"],
                            fused=True)
    state = {p: (torch.zeros_like(p), torch.zeros_like(p), torch.zeros(())) for p in ps}
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=gen) for p in ps]
        scale = torch.tensor(1.7)
        for q, g in zip(qs, grads, strict=True):
            q.grad = g.clone()
        opt.grad_scale = scale
        opt.step()
        for group, wd in ((range(2), HP["weight_decay"]), (range(2, len(ps)), 0.0)):
            for i in group:
                state[ps[i]][2].add_(1)
            adamw_step_([ps[i].data for i in group], [grads[i] for i in group],
                        [state[ps[i]][0] for i in group], [state[ps[i]][1] for i in group],
                        [state[ps[i]][2] for i in group],
                        **{**HP, "weight_decay": wd}, grad_scale=scale, impl="triton")
    for p, q in zip(ps, qs, strict=True):
        torch.testing.assert_close(p.data, q.data, atol=1e-6, rtol=1e-5)


def test_kernel_refuses_what_it_cannot_update(triton_cpu):
    gen = torch.Generator().manual_seed(2)
    ps, gs, ms, vs, ss = _state(torch.float32, gen)
    with pytest.raises(KernelUnavailableError, match="moments"):
        adamw_step_(ps, gs, [m.bfloat16() for m in ms], vs, ss, **HP, impl="triton")
    with pytest.raises(KernelUnavailableError, match="contiguous"):
        adamw_step_([ps[0].t()], [gs[0].t()], [ms[0].t()], [vs[0].t()], ss[:1], **HP, impl="triton")
    with pytest.raises(ValueError, match="one entry each"):
        adamw_step_(ps, gs[:1], ms, vs, ss, **HP)


@pytest.mark.skipif(not _dispatch.HAS_TRITON, reason="triton not installed")
def test_adamw_kernel_vectorises_for_hopper():
    """The tensors' addresses come from a table; the alignment hint must reach the compiler, or every element
    is its own 2- or 4-byte load (a third of the bandwidth). Compiled for sm_90 in a fresh process."""
    code = ("import re\nfrom compile_specs import compile_kernel\n"
            "for k in ('_adamw_kernel#bfloat16bfloat16', '_adamw_kernel#float32float32', '_sumsq_kernel#bfloat16'):\n"
            "    ptx = compile_kernel('adamw.' + k).asm['ptx']\n"
            "    print(k, 'ld.global.v4' in ptx and ('st.global.v4' in ptx or 'sumsq' in k))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
                            "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                        os.environ.get("PYTHONPATH")]))})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[1::2] == ["True"] * 3, r.stdout


@pytest.mark.parametrize("dtype,weight_decay", [(torch.float32, 0.1), (torch.bfloat16, 0.1), (torch.bfloat16, 0.05),
                                                (torch.bfloat16, 1.0), (torch.float16, 0.01)])
def test_row_sparse_tables_update_like_dense_ones(triton_cpu, dtype, weight_decay):
    """Row-sparse tables (rows straddling blocks, and rows longer than a block) give bit-for-bit the dense
    plan's parameters and moments over steps that touch different rows; a plan rebuilt on the resulting state
    (a resume) finds the touched blocks from the moments; the norm's sum of squares skips nothing nonzero.
    Untouched blocks either decay (fp32; lr x weight decay 1e-3 and 1e-2 in bf16) or are not even read (bf16 at
    5e-4 <= 2^-10, fp16 at 1e-4 <= 2^-13: the decay rounds back to every value)."""
    from loongforge_kernels.adamw import decay_is_noop

    hp = {**HP, "weight_decay": weight_decay}
    skips = decay_is_noop(dtype, hp["lr"], weight_decay)
    assert skips == ((dtype, weight_decay) in ((torch.bfloat16, 0.05), (torch.float16, 0.01)))
    gen = torch.Generator().manual_seed(3)
    shapes = [(400, 48), (7, 2500), (300,)]  # CPU blocks are 1024 elements: 19 of them in the first table
    sparse = [True, True, False]

    def state():
        g = torch.Generator().manual_seed(4)
        return ([torch.randn(s, generator=g).to(dtype) for s in shapes], [torch.zeros(s, dtype=dtype) for s in shapes],
                [torch.zeros(s, dtype=dtype) for s in shapes], [torch.zeros(()) for _ in shapes])

    ps, ms, vs, ss = state()
    qs, mq, vq, sq = state()
    sparse_plan, dense_plan = AdamWPlan(ps, ms, vs, ss, row_sparse=sparse), AdamWPlan(qs, mq, vq, sq)
    for step in range(5):
        if step == 3:  # a resume: new plans over the same tensors
            sparse_plan, dense_plan = AdamWPlan(ps, ms, vs, ss, row_sparse=sparse), AdamWPlan(qs, mq, vq, sq)
        grads = [torch.zeros(s, dtype=dtype) for s in shapes]
        rows = [torch.randint(0, 60, (5,), generator=gen), torch.randint(0, 7, (1,), generator=gen)]
        for t, r in enumerate(rows):
            grads[t][r] = torch.randn(grads[t][r].shape, generator=gen).to(dtype)
            if step != 4:  # NOTE: step 4 marks nothing: its touched rows must already be active
                sparse_plan.mark_rows(t, r)
        grads[2] = torch.randn(300, generator=gen).to(dtype)
        if step == 4:
            grads[0].zero_()
            grads[1].zero_()
        for s in ss + sq:
            s.add_(1)
        checked = sparse_plan.check(grads)
        total = sparse_plan.grad_sumsq(checked)
        torch.testing.assert_close(total, sum(g.float().square().sum() for g in grads), rtol=1e-5, atol=0)
        sparse_plan.launch(checked, **hp)
        dense_plan.step(grads, **hp)
        for a, b in zip(ps + ms + vs, qs + mq + vq, strict=True):
            assert torch.equal(a, b), step
    untouched = slice(100, None)  # NOTE: blocks 5.. of the first table never became active, and still decayed
    assert int(sparse_plan.launches[0].active[5:19].sum()) == 0
    if dtype == torch.float32 or weight_decay == 1.0:  # (in bf16 a 1e-3 decay is below half an ulp)
        assert not torch.equal(ps[0][untouched], state()[0][0][untouched])


def test_row_sparse_needs_a_table(triton_cpu):
    t = [torch.zeros(4)]
    with pytest.raises(ValueError, match="2-D"):
        AdamWPlan(t, [torch.zeros(4)], [torch.zeros(4)], [torch.zeros(())], row_sparse=[True])
    plan = AdamWPlan(t, [torch.zeros(4)], [torch.zeros(4)], [torch.zeros(())])
    with pytest.raises(ValueError, match="not declared row-sparse"):
        plan.mark_rows(0, torch.tensor([0]))

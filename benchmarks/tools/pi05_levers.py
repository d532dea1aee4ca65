"""Where pi05's remaining step time could come from, measured in isolation on one GPU (no LeRobot needed).

1. **Optimizer**: torch's fused AdamW over pi05's main trainable tensors (the real shapes and dtypes of the
   Gemma / SigLIP weights and the token table, ~2.7B bf16 + 0.41B fp32; the small adaRMS / action projections
   left out) vs the same number of elements as one flat tensor per dtype, with the bytes each moves per step
   (read p, g, m, v; write p, m, v) as achieved bandwidth.
2. **Vision tower**: one SigLIP So400m encoder layer (transformers' ``SiglipEncoderLayer``, fp32 params under bf16
   autocast as LeRobot's pi05 keeps them, batch 16 × 256 patches), ``torch.compile``d, forward + backward, vs the
   same layer with q/k/v as one GEMM (the same math), as achieved TFLOP/s.

    python benchmarks/tools/pi05_levers.py [--out FILE.md]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn


def _timed(fn, *, warmup: int = 3, reps: int = 10) -> float:
    """Wall seconds per call (host included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def _gpu_time(fn, *, warmup: int = 5, reps: int = 10) -> float:
    """Kernel seconds per call (the sum of the CUDA kernels' own times, as the profiler records them): what the
    call costs inside a step that keeps the GPU busy (CUDA graphs), free of this host's ~20 µs launches."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e6 / reps


def pi05_param_shapes() -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Trainable tensors of LeRobot's pi05 as our trainer builds it (bf16 split; frozen lm_heads / dead last-layer
    parts excluded), from the model's real sizes."""
    bf, f32 = torch.bfloat16, torch.float32
    shapes: list[tuple[tuple[int, ...], torch.dtype]] = [((257152, 2048), bf)]  # PaliGemma token table
    for width, mlp, layers in ((2048, 16384, 18), (1024, 4096, 18)):  # Gemma-2B prefix, Gemma-300M expert
        for i in range(layers):
            last_prefix = width == 2048 and i == layers - 1
            attn = [((256, width), bf), ((256, width), bf)]  # k, v (1 KV head of 256)
            if not last_prefix:
                attn += [((2048, width), bf), ((width, 2048), bf)]  # q (8 heads x 256), o
                attn += [((mlp, width), bf)] * 2 + [((width, mlp), bf)] + [((width,), f32)] * 2
            else:
                attn += [((width,), f32)]
            shapes += attn
    for _ in range(27):  # SigLIP So400m/14, fp32 (LeRobot's split)
        shapes += [((1152, 1152), f32), ((1152,), f32)] * 4 + [((4304, 1152), f32), ((4304,), f32),
                                                                ((1152, 4304), f32), ((1152,), f32)]
        shapes += [((1152,), f32)] * 4
    shapes += [((2048, 1152), f32), ((2048,), f32)]  # projector
    return shapes


def bench_adamw() -> list[str]:
    """torch's fused AdamW with a ``grad_scale`` (as the trainer steps it: the clip rides in the kernel) vs ours
    (``loongforge_kernels.adamw``, the trainer's ``KernelAdamW``) at a few block sizes, over pi05's tensors."""
    from loongforge_embodied.optim import KernelAdamW
    from loongforge_kernels import adamw as kernel

    dev = torch.device("cuda")
    shapes = pi05_param_shapes()

    def make(cls):
        params = [nn.Parameter(torch.randn(s, dtype=d, device=dev) * 0.02) for s, d in shapes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt = cls(params, lr=1e-5, weight_decay=0.01, fused=True)
        opt.grad_scale = torch.tensor(1.5, device=dev)
        return params, opt

    numel = {d: sum(torch.Size(s).numel() for s, dd in shapes if dd == d) for d in (torch.bfloat16, torch.float32)}
    # NOTE: per element read p, g, m, v and write p, m, v; torch's fused kernel also writes g back under grad_scale
    size = {torch.bfloat16: 2, torch.float32: 4}
    moved = {w: sum(n * w * size[d] for d, n in numel.items()) for w in (7, 8)}
    rows = []
    default = kernel.BLOCK["cuda"], kernel.NUM_WARPS
    variants = [("torch fused AdamW (writes the unscaled grads back)", torch.optim.AdamW, None, 8)]
    variants += [(f"ours, Triton, {b} elements x {w} warps a program", KernelAdamW, (b, w), 7)
                 for b, w in ((4096, 8), (2048, 4), (8192, 8), (8192, 16))]
    for name, cls, cfg, words in variants:
        if cfg:
            kernel.BLOCK["cuda"], kernel.NUM_WARPS = cfg
        params, opt = make(cls)
        dt = _gpu_time(opt.step, warmup=3, reps=5)
        wall = _timed(opt.step, warmup=1, reps=5)
        rows.append(f"| {name} | {dt * 1e3:.2f} ms | {moved[words] / dt / 1e12:.2f} TB/s | {wall * 1e3:.2f} ms |")
        del params, opt
        torch.cuda.empty_cache()
    kernel.BLOCK["cuda"], kernel.NUM_WARPS = default
    head = [f"AdamW over {numel[torch.bfloat16] / 1e9:.2f}B bf16 + {numel[torch.float32] / 1e9:.2f}B fp32 elements "
            f"({moved[7] / 1e9:.1f} GB read + written per step by ours, {moved[8] / 1e9:.1f} GB by torch's)", "",
            "| variant | GPU time / step | bandwidth | wall / step (host included) |", "|---|---:|---:|---:|"]
    return head + rows


class _FusedQKV(nn.Module):
    """``SiglipAttention`` with q/k/v computed by one linear (weights concatenated): the same math."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn
        self.qkv = nn.Linear(attn.embed_dim, 3 * attn.embed_dim, device=attn.q_proj.weight.device)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
            self.qkv.bias.copy_(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        b, n, c = hidden_states.shape
        a = self.attn
        q, k, v = self.qkv(hidden_states).view(b, n, 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=a.scale)
        return a.out_proj(out.transpose(1, 2).reshape(b, n, c)), None


def bench_siglip(batch: int = 16) -> list[str]:
    from transformers import SiglipVisionConfig
    from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer

    cfg = SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_attention_heads=16, num_hidden_layers=27,
                             image_size=224, patch_size=14)
    cfg._attn_implementation = "sdpa"
    dev = torch.device("cuda")
    tokens, width, mlp = batch * 256, 1152, 4304
    flops = 3 * (2 * tokens * width * (4 * width + 2 * mlp) + 4 * batch * 16 * 256 * 256 * 72)  # fwd + 2x bwd
    rows = []
    for name, fuse in (("transformers' layer (q, k, v separate)", False), ("q/k/v as one GEMM", True)):
        torch.manual_seed(0)
        layer = SiglipEncoderLayer(cfg).to(dev)
        if fuse:
            layer.self_attn = _FusedQKV(layer.self_attn)
        x = torch.randn(batch, 256, width, device=dev, requires_grad=True)
        body = torch.compile(layer)

        def step(body=body, x=x):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = body(x, None)
            out = out[0] if isinstance(out, tuple) else out
            out.float().square().mean().backward()

        wall, gpu = _timed(step, warmup=5, reps=30), _gpu_time(step)
        rows.append(f"| SigLIP So400m layer, {name} | {gpu * 1e3:.3f} ms | {flops / gpu / 1e12:.0f} TFLOP/s | "
                    f"{wall * 1e3:.3f} ms |")
    head = [f"One SigLIP So400m encoder layer, batch {batch} x 256 patches, fp32 params under bf16 autocast, "
            "torch.compile, forward + backward (GPU time: the kernels' own time; wall: host-bound here)", "",
            "| variant | GPU time | achieved | wall |", "|---|---:|---:|---:|"]
    return head + rows


def _masked_eager(q, k, v, valid, scale):
    """Attention as LeRobot's eager step computes it (scores from a bf16 GEMM, softmax in fp32, probabilities back
    in bf16), with a key-padding mask: q (B, Lq, D), k / v (B, Lk, D), valid (B, Lk)."""
    scores = torch.matmul(q, k.transpose(1, 2)) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def bench_attention(batch: int = 16) -> list[str]:
    """pi05's attention calls in a training step, forward + backward, by backend.

    Joint layer (x 17): prefix queries (256 image + 32 prompt tokens, 8 heads folded into the rows: MQA over one
    key-value head of 256) over the prefix keys, and 50 action queries x 8 heads over all keys, with a key-padding
    mask (a few padded prompt tokens per sample). SigLIP (x 27): 16 heads of 72 over 256 patches, no mask."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    n_prefix, n_act, d, heads = 288, 50, 256, 8
    lengths = n_prefix - torch.randint(0, 6, (batch,), device=dev, generator=g)  # padded prompt tails
    valid = torch.arange(n_prefix + n_act, device=dev)[None, :] < lengths[:, None]
    valid[:, n_prefix:] = True
    scale = d ** -0.5

    def leaf(*shape):
        return (torch.randn(*shape, device=dev, dtype=bf, generator=g) * 0.5).requires_grad_()

    qp, qa = leaf(batch, n_prefix * heads, d), leaf(batch, n_act * heads, d)
    k, v = leaf(batch, n_prefix + n_act, d), leaf(batch, n_prefix + n_act, d)

    def joint_sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                outs = []
                for q, n in ((qp, n_prefix), (qa, n_prefix + n_act)):
                    outs.append(F.scaled_dot_product_attention(q[:, None], k[:, None, :n], v[:, None, :n],
                                                               attn_mask=valid[:, None, None, :n], scale=scale))
            return outs
        return run

    eager = torch.compile(_masked_eager)

    def joint_eager():
        return [eager(qp, k[:, :n_prefix], v[:, :n_prefix], valid[:, :n_prefix], scale),
                eager(qa, k, v, valid, scale)]

    flex = torch.compile(flex_attention)
    masks = {}
    for n_q, n_k in ((n_prefix * heads, n_prefix), (n_act * heads, n_prefix + n_act)):
        vk = valid[:, :n_k]
        masks[n_q] = create_block_mask(lambda b, h, qi, ki, vk=vk: vk[b, ki], batch, None, n_q, n_k, device=dev)

    def joint_flex():
        return [flex(qp[:, None], k[:, None, :n_prefix], v[:, None, :n_prefix], block_mask=masks[n_prefix * heads],
                     scale=scale),
                flex(qa[:, None], k[:, None], v[:, None], block_mask=masks[n_act * heads], scale=scale)]

    ref = [o.float() for o in joint_sdpa([SDPBackend.MATH])()]
    rows = []

    def measure(name, fn, per_step=17):
        def step():
            outs = fn()
            sum(o.float().square().mean() for o in outs).backward()
        try:
            err = max((o.float().squeeze(1) - r.squeeze(1)).abs().max().item() for o, r in zip(fn(), ref, strict=True))
            gpu = _gpu_time(step, reps=20)
        except Exception as e:  # noqa: BLE001 — a backend that cannot take these shapes is a row, not a crash
            rows.append(f"| {name} | failed: {type(e).__name__}: {str(e)[:80]} | | |")
            return
        rows.append(f"| {name} | {gpu * 1e3:.3f} ms | x{per_step} = {gpu * per_step * 1e3:.2f} ms | {err:.1e} |")

    measure("joint: SDPA default dispatch", joint_sdpa([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                                        SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]))
    measure("joint: SDPA cuDNN", joint_sdpa([SDPBackend.CUDNN_ATTENTION]))
    measure("joint: SDPA efficient", joint_sdpa([SDPBackend.EFFICIENT_ATTENTION]))
    measure("joint: eager, compiled (LeRobot's math: bf16 scores, fp32 softmax)", joint_eager)
    measure("joint: flex_attention, compiled", joint_flex)

    sq, sk, sv = (leaf(batch, 16, 256, 72) for _ in range(3))
    sref = [F.scaled_dot_product_attention(sq.float(), sk.float(), sv.float())]
    ref[:] = sref

    def siglip(backend):
        def run():
            with sdpa_kernel(backend):
                return [F.scaled_dot_product_attention(sq, sk, sv)]
        return run

    seager = torch.compile(lambda q, k, v: torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * 72 ** -0.5,
                                                                      dim=-1, dtype=torch.float32).to(q.dtype), v))
    for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        measure(f"SigLIP: SDPA {name}", siglip([backend]), 27)
    measure("SigLIP: eager, compiled", lambda: [seager(sq, sk, sv)], 27)
    head = [f"pi05's attention, batch {batch}, forward + backward GPU time (kernels' own time) per call, bf16",
            "", "| variant | GPU time | per step | max err vs fp32 math |", "|---|---:|---:|---:|"]
    return head + rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", choices=("adamw", "siglip", "attention"), default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pi05_levers needs a CUDA GPU")
    lines = [f"# pi05 levers on {torch.cuda.get_device_name()}", ""]
    for part in (bench_adamw, bench_siglip, bench_attention):
        if args.only and part.__name__ != f"bench_{args.only}":
            continue
        lines += part() + [""]
        print("\n".join(lines), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines))


if __name__ == "__main__":
    main()

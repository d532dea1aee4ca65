"""``train.overlap_optimizer``: the AdamW step cut into chunks in forward order (on CPU inline, on CUDA on a side
stream) gives the parameters of a plain ``optimizer.step()`` bitwise; recipes that cannot overlap are refused.
The CUDA side (stream, waits, CUDA graphs) is ``test_gpu_compile.py::test_overlapped_optimizer_*``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loongforge.errors import RecipeError
from loongforge.recipe import load_recipe
from loongforge_embodied.optim_overlap import OverlappedStep, before_use, plan_chunks
from torch import nn

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "embodied" / "tiny_vla_synthetic.yaml"
PI05 = ROOT / "recipes" / "embodied" / "lerobot_pi05_tiny.yaml"


class Toy(nn.Module):
    """An embedding (in no unit), three blocks (the units; one kept in bf16) and a head (in no unit)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)) for _ in range(3))
        self.blocks[1].to(torch.bfloat16)
        self.head = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h.to(b[0].weight.dtype)).float()
        return self.head(h).square().mean()


def _groups(model: nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    keep = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": keep, "weight_decay": 0.0}]


def test_chunks_hold_every_parameter_once_in_forward_order():
    model = Toy()
    params = list(model.parameters())
    chunks, unit_chunk = plan_chunks(model.blocks, params, min_chunk=1)
    assert sorted(map(id, (p for c in chunks for p in c))) == sorted(map(id, params))
    assert {id(p) for p in chunks[0]} == {id(p) for m in (model.embed, model.head) for p in m.parameters()}
    assert unit_chunk == [1, 2, 3] and [list(model.blocks[i].parameters()) for i in range(3)] == chunks[1:]
    # NOTE: small units merge until a chunk holds min_chunk elements (16*16 + 3*16 = 304 per block)
    chunks, unit_chunk = plan_chunks(model.blocks, params, min_chunk=500)
    assert unit_chunk == [1, 1, 2] and len(chunks) == 3


@pytest.mark.parametrize("fused", [False, True])
def test_chunked_step_is_the_optimizer_step_bitwise(fused):
    """Three steps (the first initialises the state through ``optimizer.step()``), weight decay in one group,
    a bf16 unit, EMA updated per chunk, and (fused) the clip applied as ``grad_scale``."""
    torch.manual_seed(0)
    ref, ours = Toy(), Toy()
    ours.load_state_dict(ref.state_dict())
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "fused": True} if fused else \
        {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "foreach": True}
    opt_ref, opt = torch.optim.AdamW(_groups(ref), **kw), torch.optim.AdamW(_groups(ours), **kw)
    ema_ref = {p: p.detach().clone() for p in ref.parameters()}
    ema = {p: p.detach().clone() for p in ours.parameters()}
    step = OverlappedStep(opt, list(ours.blocks), device=torch.device("cpu"), ema=ema, ema_decay=0.9)
    assert len(step) == 2  # the blocks are small: one chunk after the no-unit one
    for i in range(3):
        ids = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(i))
        ref(ids).backward()
        step.wait(0)
        ours(ids).backward()
        step.drain()
        scale = torch.tensor(1.0 + i, dtype=torch.float32) if fused else None
        if scale is not None:
            opt_ref.grad_scale = scale
        else:
            for p in ref.parameters():
                p.grad.div_(1.0 + i)
            for p in ours.parameters():
                p.grad.div_(1.0 + i)
        opt_ref.step()
        opt_ref.grad_scale = None
        opt_ref.zero_grad()
        torch._foreach_lerp_(list(ema_ref.values()), [p.detach() for p in ema_ref], 0.1)
        step.launch(grad_scale=scale, zero_grads=False)
        opt.zero_grad()
        step.finish()
        for (n, a), b in zip(ref.named_parameters(), ours.parameters(), strict=True):
            assert torch.equal(a, b), (i, n)
            assert torch.equal(opt_ref.state[a]["exp_avg_sq"], opt.state[b]["exp_avg_sq"]), (i, n)
            assert torch.equal(ema_ref[a], ema[b]), (i, n)


def test_staged_gradients_give_the_plain_clip_and_step_bitwise():
    """One micro-batch, one process: each chunk's gradients are copied out as backward lands them (post-accumulate
    hooks) and their norms taken there; the global norm, clip scale and update then match ``clip_grad_norm`` +
    ``optimizer.step()`` bitwise (fused AdamW, so the clip is the kernel's ``grad_scale``), first step included."""
    from loongforge_embodied.parallel import clip_grad_norm

    torch.manual_seed(0)
    ref, ours = Toy(), Toy()
    ours.load_state_dict(ref.state_dict())
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "fused": True}
    opt_ref, opt = torch.optim.AdamW(_groups(ref), **kw), torch.optim.AdamW(_groups(ours), **kw)
    step = OverlappedStep(opt, list(ours.blocks), device=torch.device("cpu"), min_chunk=1)
    step.stage_gradients(max_norm=0.05, scale_in_kernel=True, norm_order=list(ours.parameters()))
    staged: list[int] = []
    stage = step._stage
    step._stage = lambda c: (staged.append(c), stage(c))
    for i in range(3):
        ids = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(i))
        ref(ids).backward()
        norm_ref = clip_grad_norm(list(ref.parameters()), 0.05, into=opt_ref)
        assert float(opt_ref.grad_scale) > 1  # NOTE: the clip is active
        opt_ref.step()
        opt_ref.grad_scale = None
        opt_ref.zero_grad()
        step.wait(0)
        ours(ids).backward()
        assert staged == [3, 2, 1, 0]  # NOTE: the blocks' chunks in backward order; the no-unit chunk at the end
        staged.clear()
        step.drain()
        norm = step.after_backward()
        opt.zero_grad()
        step.finish()
        assert torch.equal(norm, norm_ref), i
        for (n, a), b in zip(ref.named_parameters(), ours.parameters(), strict=True):
            assert torch.equal(a, b), (i, n)


def test_units_wait_through_hooks_compiled_calls_and_before_use():
    """A unit waits for its chunk when it runs (pre-hook), when compiled (around the compiled call: a hook would be
    traced), and where a policy reads its weights without calling it (``before_use``)."""
    model = Toy()
    model.blocks[2].compile(backend="eager")
    rec = _Recording(torch.optim.AdamW(_groups(model), lr=1e-3), list(model.blocks))
    assert len(rec) == 4  # min_chunk=1: one chunk per block after the no-unit one
    h = model.embed(torch.randint(0, 11, (2, 3)))
    model.blocks[0](h)
    model.blocks[2](h)
    before_use(model.blocks[1])
    assert rec.calls == [1, 3, 2]
    before_use(nn.Linear(2, 2))  # a module nothing overlaps: no wait, no error


class _Recording(OverlappedStep):
    def __init__(self, optimizer, units):
        self.calls: list[int] = []
        super().__init__(optimizer, units, device=torch.device("cpu"), min_chunk=1)

    def wait(self, chunk: int) -> None:
        self.calls.append(chunk)


def _train(recipe: Path, tmp: Path, *over: str, steps: int = 4, mbs: int = 2) -> tuple[list[float], dict]:
    from loongforge.api import build_job

    base = [f"train.steps={steps}", "train.global_batch_size=4", f"train.micro_batch_size={mbs}", "train.ema_decay=0.9",
            "checkpoint.resume=never", "checkpoint.save_at_end=false", "logging.console=false",
            "logging.tensorboard=false"]
    job, _ = build_job(load_recipe(recipe, [*base, *over]), output_dir=tmp)
    try:
        losses = [job.step()["loss"] for _ in range(steps)]
        job.settle()
        state = {n: p.detach().clone() for n, p in job.model.raw.named_parameters()}
        state.update({f"ema.{n}": e.clone() for n, e in job.ema.items()})
        return losses, state
    finally:
        job.close()


@pytest.mark.parametrize(("recipe", "mbs"), [(RECIPE, 2), (PI05, 4)], ids=["tiny_vla-accumulated", "lerobot_pi05-staged"])
def test_overlapped_job_trains_the_plain_losses_and_weights(tmp_path, recipe, mbs):
    """The job with ``train.overlap_optimizer`` (EMA, grad clip; two micro-batches: the update after backward;
    one: gradients staged during backward; lerobot_pi05's joint step waits through ``before_use``) ends with the
    plain job's losses, weights and EMA, bitwise."""
    plain = _train(recipe, tmp_path / "plain", mbs=mbs)
    overlapped = _train(recipe, tmp_path / "overlap", "train.overlap_optimizer=true", mbs=mbs)
    assert overlapped[0] == plain[0]
    assert plain[1].keys() == overlapped[1].keys()
    for name, value in plain[1].items():
        assert torch.equal(value, overlapped[1][name]), name


def test_recipes_that_cannot_overlap_are_refused():
    from loongforge_embodied.backend import EmbodiedBackend

    with pytest.raises(RecipeError, match="overlaps AdamW steps") as e:
        load_recipe(RECIPE, ["train.overlap_optimizer=true", "train.optimizer=sgd"])
    assert e.value.key == "train.overlap_optimizer"
    for strategy in ("fsdp2", "zero1"):
        recipe = load_recipe(RECIPE, ["train.overlap_optimizer=true", f"parallel.strategy={strategy}"])
        with pytest.raises(RecipeError, match=f"got '{strategy}' on 2 process") as e:
            EmbodiedBackend().validate(recipe, world_size=2)
        assert e.value.key == "train.overlap_optimizer"
    EmbodiedBackend().validate(load_recipe(RECIPE, ["train.overlap_optimizer=true", "parallel.strategy=ddp"]),
                               world_size=2)

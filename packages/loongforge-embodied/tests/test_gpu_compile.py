"""``train.compile`` on a CUDA GPU: LeRobot's pi05 (tiny preset) trains the same losses eager, compiled, and
compiled with CUDA graphs (``compile_mode: reduce-overhead``) — skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _losses(tmp_path: Path, *over: str, steps: int = 4) -> list[float]:
    from loongforge.api import build_job, load_recipe

    base = [f"train.steps={steps}", "train.global_batch_size=4", "train.micro_batch_size=4", "accelerator=cuda",
            "train.precision=fp32", "checkpoint.resume=never", "checkpoint.save_at_end=false",
            "logging.console=false", "logging.tensorboard=false"]
    from torch._dynamo.utils import counters

    job, _ = build_job(load_recipe(ROOT / "recipes/embodied/lerobot_pi05_tiny.yaml", [*base, *over]),
                       output_dir=tmp_path / "_".join(over or ("eager",)).replace("=", "-"))
    counters["inductor"]["cudagraph_skips"] = 0
    try:
        losses = [job.step(report=True)["loss"] for _ in range(steps)]
        if "train.compile_mode=reduce-overhead" in over:
            _assert_graphs_recorded()
        return losses
    finally:
        job.close()


def _assert_graphs_recorded() -> None:
    """The graphed run really replayed CUDA graphs: inductor skipped none, and its graph tree holds recordings
    (equal losses alone would also pass if every unit had silently fallen back to plain compiled code)."""
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_trees import get_manager

    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and sum(len(nodes) for nodes in manager.roots.values()) > 0


def test_cuda_graphs_train_the_eager_losses(tmp_path):
    """Every step's loss matches eager's, so graphs replay on fresh inputs and read the updated weights.

    Seen on an H200 (torch 2.11, these settings, one process per variant): eager and graphed
    losses equal to 1e-7 in fp32 (bf16: within 1.2e-3)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    eager = _losses(tmp_path)
    compiled = _losses(tmp_path, "train.compile=true")
    graphs = _losses(tmp_path, "train.compile=true", "train.compile_mode=reduce-overhead")
    assert compiled == pytest.approx(eager, rel=1e-4), (eager, compiled)
    assert graphs == pytest.approx(eager, rel=1e-4), (eager, graphs)
    assert len(set(graphs)) == len(graphs)  # the steps differ: no stale replay of step 1


def test_cuda_graphs_follow_changing_prompt_widths(tmp_path, monkeypatch):
    """Prompts padded to each batch's longest (``prompt_pad_multiple=1``: the width follows the state digits) give
    several prefix lengths; the graphed run recompiles / records per width and still trains eager's losses."""
    from loongforge_embodied.policies.lerobot_pi05 import processor_lerobot_pi05 as proc

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    widths: list[int] = []
    encode = proc.encode_prompts

    def recording(*a, **k):
        ids, mask = encode(*a, **k)
        widths.append(ids.shape[1])
        return ids, mask

    monkeypatch.setattr(proc, "encode_prompts", recording)
    over = ("data.num_workers=0", "model.arch.prompt_pad_multiple=1", "model.arch.prompt_padding=longest")
    eager = _losses(tmp_path, *over, steps=6)
    seen_eager, widths[:] = sorted(set(widths)), []
    graphs = _losses(tmp_path, *over, "train.compile=true", "train.compile_mode=reduce-overhead", steps=6)
    assert len(set(widths)) >= 2 and sorted(set(widths)) == seen_eager, (widths, seen_eager)
    assert graphs == pytest.approx(eager, rel=1e-4), (eager, graphs)


def test_cuda_graphs_accumulate_gradients(tmp_path):
    """Two micro-batches a step under CUDA graphs train the losses of one micro-batch of the same global batch.

    Before the job kept ``.grad`` resident, the second micro-batch's replay overwrote the first one's gradient
    that AccumulateGrad had taken from graph memory (pytorch/pytorch#169545): on an H200 the first step's
    backward failed with "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run"."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    one = _losses(tmp_path)
    eager = _losses(tmp_path, "train.micro_batch_size=2")
    graphs = _losses(tmp_path, "train.micro_batch_size=2", "train.compile=true", "train.compile_mode=reduce-overhead")
    assert eager == pytest.approx(one, rel=1e-4), (one, eager)
    assert graphs == pytest.approx(eager, rel=1e-4), (eager, graphs)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_cuda_graphs_under_ddp_two_gpus(tmp_path, ranks):
    """DDP (and ZeRO-1, which trains through the same DDP wrapper) on 2 GPUs with CUDA graphs train the losses of
    one graphed process with the same global batch. DDP copies each graph-output gradient into its bucket
    (``gradient_as_bucket_view``), so the all-reduce never reads graph memory a later replay overwrites."""
    from .strategy_losses import run_strategies

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    graphs = ("train.compile=true", "train.compile_mode=reduce-overhead")
    one = _losses(tmp_path, *graphs)
    common = ("accelerator=cuda", "train.precision=fp32", "train.global_batch_size=4")
    runs = {}
    for name, extra in (("mb2", "train.micro_batch_size=2"), ("mb1-accum", "train.micro_batch_size=1")):
        runs[name] = ranks(run_strategies, world=2, out=tmp_path / name, timeout_s=600, backend="nccl",
                           recipe_name="lerobot_pi05_tiny.yaml", steps=4, strategies=["ddp", "zero1"],
                           extra=(*common, extra, *graphs))[0]["losses"]
    for name, result in runs.items():
        for strategy, losses in result.items():
            assert losses == pytest.approx(one, rel=1e-4), (name, strategy, one, losses)


def test_unreported_steps_never_wait_for_the_gpu(tmp_path):
    """A step that reports nothing queues its work and returns: no host sync anywhere in it (data copy, LeRobot's
    forward and its mask tensors, backward, clip, our AdamW kernel), checked by CUDA's sync debug mode, which
    raises on any synchronising call. Without ``pi05-async-masks`` LeRobot's two mask tensors sync every step."""
    from loongforge.api import build_job, load_recipe

    over = ["train.steps=4", "train.global_batch_size=4", "train.micro_batch_size=4", "accelerator=cuda",
            "train.precision=bf16", "checkpoint.resume=never", "checkpoint.save_at_end=false", "logging.console=false",
            "logging.tensorboard=false", "data.num_workers=0"]
    job, _ = build_job(load_recipe(ROOT / "recipes/embodied/lerobot_pi05_tiny.yaml", over), output_dir=tmp_path)
    try:
        job.step(report=True)  # first step: optimizer state, plans and allocator caches are created
        job.step(report=False)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            job.step(report=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        metrics = job.step(report=True)
        assert metrics["loss"] == metrics["loss"]  # finite
    finally:
        job.close()


def test_kernel_adamw_trains_torch_adamws_losses(tmp_path, monkeypatch):
    """The job's optimizer on CUDA (our AdamW kernel, the row-sparse token table, the clip's norm from the same
    table) vs torch's fused AdamW + foreach norm (``kernels.provider=torch``): the same losses and weights
    over 5 steps, fp32 (TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from loongforge.api import build_job, load_recipe

    over = ["train.steps=5", "train.global_batch_size=4", "train.micro_batch_size=4", "accelerator=cuda",
            "train.precision=fp32", "train.lr=1e-3", "checkpoint.resume=never", "checkpoint.save_at_end=false",
            "logging.console=false", "logging.tensorboard=false"]
    runs = {}
    for impl in ("auto", "torch"):
        job, _ = build_job(load_recipe(ROOT / "recipes/embodied/lerobot_pi05_tiny.yaml", [*over, f"kernels.provider={impl}"]),
                           output_dir=tmp_path / impl)
        try:
            losses = [job.step(report=True)["loss"] for _ in range(5)]
            if impl == "auto":
                assert job.optimizer._plans and job._mark_rows  # the kernel path ran, rows were marked
            runs[impl] = losses, {n: p.detach().clone() for n, p in job.model.raw.named_parameters()}
        finally:
            job.close()
    assert runs["auto"][0] == pytest.approx(runs["torch"][0], rel=1e-5), (runs["auto"][0], runs["torch"][0])
    for name, value in runs["torch"][1].items():
        torch.testing.assert_close(runs["auto"][1][name], value, rtol=1e-4, atol=1e-5, msg=name)

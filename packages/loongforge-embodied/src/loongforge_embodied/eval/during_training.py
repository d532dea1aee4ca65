"""``train.eval_interval`` in the embodied backend: closed-loop episodes on the weights being trained.

Every evaluation exports the current weights (the EMA where ``train.ema_decay`` is set, as the final export),
serves that export with the machinery of ``loongforge eval`` (server, openpi-client workers, summary), and logs
``eval/success_rate``, ``eval/success_ci_low`` / ``_high``, ``eval/mean_return`` and ``eval/mean_length``.
The episodes are ``train.eval_steps`` seeded ones (``data.eval_seed + i``: the same at every evaluation).
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loongforge_embodied.job import EmbodiedJob


def evaluate_job(job: EmbodiedJob) -> dict[str, float]:
    """Run one evaluation (collective: every rank calls it; rank 0 rolls out). Returns rank 0's metrics."""
    import torch.distributed as dist

    r, rt = job.recipe, job.runtime
    d = r.data
    out = rt.output_dir / "eval" / f"step_{job.step_index:06d}"
    export_dir = out / "policy"
    job.export(export_dir)  # NOTE: collective (the full weights are gathered under fsdp2 / hsdp)
    metrics: dict[str, float] = {}
    if rt.is_main:
        from loongforge_embodied.eval.evaluate import evaluate
        from loongforge_embodied.eval.server import PolicyServer
        from loongforge_embodied.eval.trained_policy import TrainedPolicy

        policy = TrainedPolicy.load(export_dir, device=str(job.device))
        if policy.task is None:
            policy.task, policy.prompt = d.task, "optional"
        env = d.eval_env or d.record.env
        try:
            with PolicyServer(policy, port=0) as server:
                s = evaluate(address=server.address, env=env, episodes=r.train.eval_steps, workers=d.eval_workers,
                             seed=d.eval_seed, max_steps=d.eval_max_steps, out_dir=out, videos=1,
                             request_timeout_s=d.eval_request_timeout,
                             label=f"{r.model.policy} step {job.step_index}")
        finally:
            shutil.rmtree(export_dir, ignore_errors=True)  # NOTE: the summary stays; the weights are the run's
        lo, hi = s["success_ci95"]
        metrics = {"eval/success_rate": s["success_rate"], "eval/success_ci_low": lo, "eval/success_ci_high": hi,
                   "eval/mean_return": s["mean_return"], "eval/mean_length": s["mean_length"],
                   "eval/errors": float(len(s["errors"]))}
    if dist.is_initialized():
        dist.barrier()
    return metrics

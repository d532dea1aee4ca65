"""Shared fixtures: tiny random-init HF models saved by transformers itself, their reference loss, ``in_world``
(one rank of the workspace harness, tests/support/rank_harness.py, with megatron's model-parallel state); a guard
keeps megatron's process-wide state out of pytest's own process. ``ranks`` comes from the workspace harness."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from rank_harness import run_ranks

# ---- megatron jobs stay out of pytest's own process
# NOTE: megatron-core keeps process-wide state (parallel_state groups, the global memory buffer, RNG trackers, the
# microbatch calculator, torch.distributed's default group) that a job's close() does not all undo, and it would
# leak into every later test of pytest's process. Every megatron job in these tests runs in a rank
# (``ranks`` / ``in_world``) or a subprocess (``python -m loongforge``); this guard fails a test that calls
# torch.distributed.init_process_group in pytest's process, or leaves a process group or megatron's
# model-parallel state behind there.
_PYTEST_PID = os.getpid()
_IN_PROCESS_INITS: list[int] = []


def _spy_on_init_process_group() -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    real = distributed_c10d.init_process_group
    if getattr(real, "_loongforge_spy", False):
        return

    @functools.wraps(real)
    def spy(*args, **kwargs):
        if os.getpid() == _PYTEST_PID:  # NOTE: only pytest's own process counts
            _IN_PROCESS_INITS.append(1)
        return real(*args, **kwargs)

    spy._loongforge_spy = True
    dist.init_process_group = distributed_c10d.init_process_group = spy


@pytest.fixture(autouse=True)
def _megatron_state_stays_out_of_pytest():
    _spy_on_init_process_group()
    before = len(_IN_PROCESS_INITS)
    yield
    import torch.distributed as dist

    problems = []
    if len(_IN_PROCESS_INITS) > before:
        problems.append("called torch.distributed.init_process_group")
    if dist.is_available() and dist.is_initialized():
        problems.append("left torch.distributed's default process group initialized")
    mpu = sys.modules.get("megatron.core.parallel_state")
    if mpu is not None and mpu.model_parallel_is_initialized():
        problems.append("left megatron's parallel_state initialized")
    if problems:
        if mpu is not None:  # NOTE: best effort, so one offender does not fail every later test too
            mpu.destroy_model_parallel()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        pytest.fail(f"this test {', '.join(problems)} in pytest's own process: run megatron jobs in a rank "
                    "(the ranks / in_world fixtures of packages/loongforge-megatron/tests/conftest.py) or a "
                    "subprocess (python -m loongforge); megatron's process-wide state leaks into later tests",
                    pytrace=False)


COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6)


def save_tiny(family: str, out: Path, *, seed: int = 0, **over) -> Path:
    import transformers as tf

    torch.manual_seed(seed)
    if family == "llama":
        cfg = tf.LlamaConfig(**{**COMMON, **over})
        model = tf.LlamaForCausalLM(cfg)
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**{**COMMON, "head_dim": 16, **over})
        model = tf.Qwen3ForCausalLM(cfg)
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**{**COMMON, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 32, "decoder_sparse_step": 1, "norm_topk_prob": True, **over})
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif family == "deepseek_v3":
        cfg = tf.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4, "num_hidden_layers": 3, "n_routed_experts": 4,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                                     "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "q_lora_rank": 32,
                                     "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                                     "routed_scaling_factor": 2.5, **over})
        model = tf.DeepseekV3ForCausalLM(cfg)
    else:
        raise ValueError(family)
    with torch.no_grad():  # make every tensor non-trivial (HF inits some to ones/zeros)
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.01 * torch.randn_like(b))
    model.save_pretrained(out)
    return out


def hf_loss(hf_dir: Path, batches: list[dict]) -> float:
    """Token-weighted mean next-token loss of the HF model over megatron-style batches (labels pre-shifted)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    model.eval()
    total, count = 0.0, 0.0
    with torch.no_grad():
        for b in batches:
            logits = model(input_ids=b["tokens"]).logits.float()
            losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="none")
            mask = b["loss_mask"].flatten()
            total += float((losses * mask).sum())
            count += float(mask.sum())
    return total / count




@pytest.fixture
def tiny_hf():
    """``tiny_hf(family, dir, **config_overrides) -> dir``: a random-init model saved with save_pretrained."""
    return save_tiny


@pytest.fixture
def reference_loss():
    """``reference_loss(hf_dir, batches) -> float``: transformers' token-weighted loss on megatron batches."""
    return hf_loss


def _in_world_child(*, rank: int, world: int, body: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    from loongforge.accelerator.cpu import CpuAccelerator
    from loongforge.parallel.plan import resolve_plan
    from loongforge_megatron import engine
    from loongforge_megatron.device_adapters import adapted

    acc = CpuAccelerator()
    with adapted(acc):
        engine.initialize(resolve_plan(world_size=1), accelerator=acc, seed=1)
        try:
            return body(**kwargs)
        finally:
            engine.destroy(process_group=True)


def run_in_world(body: Callable[..., Any], *, out: Path, **kwargs: Any) -> Any:
    """``body(**kwargs)`` in one rank (the workspace harness' ``run_ranks``: a fresh process) inside a
    single-process gloo world + megatron model-parallel state, under the CPU adaptations; returns what ``body``
    returns (it must pickle)."""
    return run_ranks(_in_world_child, world=1, out=out, body=body, kwargs=kwargs)[0]


@pytest.fixture(scope="session")
def in_world():
    """The :func:`run_in_world` launcher (one rank in a fresh process; its state never reaches pytest's)."""
    return run_in_world

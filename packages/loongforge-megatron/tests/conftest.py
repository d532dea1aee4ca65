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
    elif family == "kimi_k2":
        # NOTE: Kimi-K2's hub checkpoints are DeepseekV3ForCausalLM models with model_type kimi_k2
        yarn = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
        cfg = tf.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4, "num_hidden_layers": 3, "n_routed_experts": 6,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                                     "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "q_lora_rank": 32,
                                     "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                                     "routed_scaling_factor": 2.827, "rope_parameters": yarn, **over})
        model = tf.DeepseekV3ForCausalLM(cfg)
    elif family == "glm4_moe":
        cfg = tf.Glm4MoeConfig(**{**COMMON, "head_dim": 16, "num_hidden_layers": 3, "n_routed_experts": 4,
                                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                                  "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
                                  "attention_bias": True, "use_qk_norm": True, **over})
        model = tf.Glm4MoeForCausalLM(cfg)
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
    if family == "kimi_k2":
        import json

        saved = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**saved, "model_type": "kimi_k2"}, indent=2))
    return out


def hf_model(hf_dir: Path) -> Any:
    """transformers' model class the checkpoint's config.json names (``architectures``), loaded in fp32."""
    import json

    import transformers as tf

    cfg = json.loads((hf_dir / "config.json").read_text())
    cls = getattr(tf, cfg["architectures"][0])
    own = cls.config_class.model_type
    if cfg.get("model_type") == own:
        return cls.from_pretrained(hf_dir, dtype=torch.float32)
    # NOTE: transformers picks its weight conversions (per-expert tensors -> fused experts) by model_type; a
    # checkpoint of another model_type on this class (Kimi-K2's kimi_k2) loads as the class's own type
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for f in hf_dir.iterdir():
            if f.is_file():
                shutil.copy2(f, tmp)
        (Path(tmp) / "config.json").write_text(json.dumps({**cfg, "model_type": own}))
        model = cls.from_pretrained(tmp, dtype=torch.float32)
        model.config.name_or_path = str(hf_dir)
    return model


def hf_loss(hf_dir: Path, batches: list[dict]) -> float:
    """Token-weighted mean next-token loss of the HF model over megatron-style batches (labels pre-shifted)."""
    model = hf_model(hf_dir)
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




def add_mtp_layers(hf_dir: Path, *, depths: int = 1, seed: int = 1) -> Path:
    """Give a saved DeepSeek-V3-layout checkpoint ``depths`` multi-token-prediction layers the way DeepSeek's own
    release lays them out: layer ``num_hidden_layers + k`` with ``enorm`` / ``hnorm`` / ``eh_proj``, a decoder
    layer (drawn by transformers: a model of ``num_hidden_layers + depths`` layers saved with save_pretrained),
    ``shared_head.norm`` and copies of the embedding and the head (``embed_tokens``, ``shared_head.head``)."""
    import json
    import tempfile

    import transformers as tf
    from safetensors.torch import load_file, save_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    tensors = load_file(hf_dir / "model.safetensors")
    config = tf.AutoConfig.from_pretrained(hf_dir)
    config.num_hidden_layers = n + depths
    torch.manual_seed(seed)
    deeper = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in deeper.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for name, b in deeper.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.01 * torch.randn_like(b))
    with tempfile.TemporaryDirectory() as tmp:
        deeper.save_pretrained(tmp)
        extra = load_file(Path(tmp) / "model.safetensors")
    for k in range(depths):
        pre = f"model.layers.{n + k}."
        tensors.update({name: t for name, t in extra.items() if name.startswith(pre)})
        tensors[pre + "enorm.weight"] = 1.0 + 0.1 * torch.randn(h)
        tensors[pre + "hnorm.weight"] = 1.0 + 0.1 * torch.randn(h)
        tensors[pre + "eh_proj.weight"] = 0.05 * torch.randn(h, 2 * h)
        tensors[pre + "shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(h)
        tensors[pre + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[pre + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, hf_dir / "model.safetensors", metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = depths
    (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return hf_dir


def mtp_reference_loss(hf_dir: Path, batches: list[dict]) -> float:
    """Depth-1 MTP loss of transformers' own model + MTP layers (``MtpModel``, loaded from the checkpoint):
    from the final hidden states and the embeddings of the next tokens, predict the token after the next; the
    masked mean per micro-batch, averaged over micro-batches (as megatron reports it)."""
    from transformers.modeling_layers import MtpModel

    main = hf_model(hf_dir).eval()
    # NOTE: transformers finds the MTP tensors by the released model's layer index (61); this one has fewer layers
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{main.config.num_hidden_layers}\..*"]
    mtp = MtpModel.from_pretrained(main).eval()
    losses = []
    with torch.no_grad():
        for b in batches:
            tokens, labels, mask = b["tokens"], b["labels"], b["loss_mask"].float()
            hidden = main.model(input_ids=tokens).last_hidden_state
            nxt = torch.roll(tokens, -1, dims=-1)
            pos = torch.arange(tokens.shape[1]).expand_as(tokens)
            out = mtp.forward_layer(0, hidden, pos, None, input_ids=nxt)
            logits = main.lm_head(out).float()
            target = torch.roll(labels, -1, dims=-1)
            m = torch.roll(mask, -1, dims=-1)
            m[:, -1] = 0
            ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
            losses.append(float((ce * m.flatten()).sum() / m.sum()))
    return sum(losses) / len(losses)


@pytest.fixture
def mtp_hf():
    """``mtp_hf(hf_dir, depths=1) -> hf_dir`` with DeepSeek-V3's MTP layers added; ``mtp_hf.loss(hf_dir,
    batches)``: transformers' depth-1 MTP loss on megatron batches."""
    add_mtp_layers.loss = mtp_reference_loss
    return add_mtp_layers


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

"""LeRobot 0.6.1's own training loop as a benchmark peer, run offline on a recorded dataset.

``run_lerobot_train`` calls LeRobot's real entry point, ``lerobot.scripts.lerobot_train.train(cfg)``, in-process with a
``TrainPipelineConfig`` built in code, and times it by wrapping ``lerobot_train.update_policy``: samples/s over the
steps after warmup therefore cover LeRobot's whole loop (DataLoader, uint8→float, preprocessor incl. tokenizer,
forward/backward/clip/step). LeRobot's code is not edited; three things make it run offline:

* pi05's processor hard-codes the ``google/paligemma-3b-pt-224`` tokenizer. ``paligemma_tokenizer_shim`` writes a small
  local stand-in into a hub-cache layout (prompts are padded to ``tokenizer_max_length`` either way, so the model sees
  the same sequence length as with the real tokenizer).
* ``TrainPipelineConfig.validate`` re-reads ``sys.argv`` for ``--policy.path`` / ``--config_path``; ``sys.argv`` is
  emptied while ``train`` runs so the caller's own flags are not taken for LeRobot's.
* Policies with an ImageNet backbone (ACT, diffusion) get ``pretrained_backbone_weights=None``: random init, no download.

One change outside the timed loop: ``make_policy`` runs under ``torch.device(cfg.device)``, so the random init of
pi05's 4.1B parameters happens on the GPU instead of the host CPU (minutes there); the policy is the same.

    uv run python benchmarks/lerobot_peer.py --root .vla_data/pusht224 --repo-id local/pusht224     # pi05 on a GPU
    uv run python benchmarks/lerobot_peer.py --root .vla_data/pusht224 --repo-id local/pusht224 --policy act \\
        --device cpu --batch 4 --steps 4 --warmup 1 --workers 1 --set dim_model=64 --set n_encoder_layers=1
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

PALIGEMMA = "google/paligemma-3b-pt-224"
_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # NOTE: Gemma's ids: pad 0, eos 1, bos 2, unk 3.


def _corpus() -> list[str]:
    """A few hundred pi05-style prompts: task text plus digit-by-digit discretised state."""
    tasks = ["Push the T-shaped block onto the target.", "push the t-shaped block onto the target.",
             "pick up the cube", "open the drawer", "stack the blocks", "put the bowl on the plate",
             "fold the towel", "insert the peg into the hole"]
    out = []
    for i in range(300):
        state = " ".join(str((i * 37 + j * 11) % 256) for j in range(8))
        out.append(f"Task: {tasks[i % len(tasks)]}, State: {state};\nAction: ")
    return out


def paligemma_tokenizer_shim(hf_home: str | Path) -> Path:
    """Write a small fast tokenizer as ``google/paligemma-3b-pt-224`` into ``hf_home``'s hub cache; returns its folder.

    Byte-level BPE (a few hundred ids, far below pi05's 257152-row embedding) with Gemma's special-token ids, a
    ``<bos>`` prefix and single-digit splitting like the real tokenizer. With ``HF_HOME=hf_home`` and
    ``HF_HUB_OFFLINE=1``, ``AutoTokenizer.from_pretrained("google/paligemma-3b-pt-224")`` loads it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", 2)])
    assert [tok.token_to_id(t) for t in _SPECIALS] == [0, 1, 2, 3]
    tok_json = tok.to_str()
    revision = hashlib.sha1(tok_json.encode()).hexdigest()
    repo = Path(hf_home) / "hub" / f"models--{PALIGEMMA.replace('/', '--')}"
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True, exist_ok=True)
    (snap / "tokenizer.json").write_text(tok_json)
    specials = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}
    (snap / "special_tokens_map.json").write_text(json.dumps(specials))
    (snap / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "padding_side": "right", "model_max_length": 1 << 20,
         "add_bos_token": True, "add_eos_token": False, **specials}))
    # NOTE: transformers 5's AutoTokenizer reads config.json (model type) before tokenizer_config.json.
    (snap / "config.json").write_text(json.dumps({"model_type": "paligemma"}))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snap


@contextlib.contextmanager
def use_hf_home(hf_home: str | Path):
    """Point the Hugging Face hub cache at ``hf_home`` (offline) while inside, also if ``huggingface_hub`` is loaded."""
    env = {"HF_HOME": str(hf_home), "HF_HUB_CACHE": str(Path(hf_home) / "hub"), "HF_HUB_OFFLINE": "1"}
    old_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    consts = sys.modules.get("huggingface_hub.constants")
    # NOTE: the hub reads these env vars into module constants at import; hub and transformers read those per call.
    old_consts = consts and (consts.HF_HOME, consts.HF_HUB_CACHE, consts.HF_HUB_OFFLINE)
    if consts:
        consts.HF_HOME, consts.HF_HUB_CACHE, consts.HF_HUB_OFFLINE = env["HF_HOME"], env["HF_HUB_CACHE"], True
    try:
        yield
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if consts:
            consts.HF_HOME, consts.HF_HUB_CACHE, consts.HF_HUB_OFFLINE = old_consts


class _StepTimer:
    """Wraps ``update_policy``: times the steps after ``warmup`` and reads LeRobot's own per-step metrics."""

    def __init__(self, update_policy, *, warmup: int, steps: int, cuda: bool, monitor=None):
        self.update_policy, self.warmup, self.steps = update_policy, warmup, steps
        self.cuda, self.monitor = cuda, monitor
        self.calls = 0
        self.t_start = self.t_end = None
        self.params = 0
        self.peak = 0
        self.data_s: list[float] = []
        self.update_s: list[float] = []
        self.loss = None

    def __call__(self, train_metrics, policy, *args, **kwargs):
        out = self.update_policy(train_metrics, policy, *args, **kwargs)
        self.calls += 1
        if self.calls == 1:
            self.params = sum(p.numel() for p in policy.parameters())
        timed = self.warmup < self.calls <= self.warmup + self.steps
        if timed:
            self.data_s.append(train_metrics.dataloading_s.val)
            self.update_s.append(train_metrics.update_s.val)
            if self.cuda:  # NOTE: update_policy resets the peak at each call, so take the max over the window.
                self.peak = max(self.peak, torch.cuda.max_memory_allocated())
        if self.calls in (self.warmup, self.warmup + self.steps):
            if self.cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            if self.calls == self.warmup:
                self.t_start = now
                if self.monitor is not None:
                    self.monitor.__enter__()
            else:
                self.t_end = now
                self.loss = train_metrics.loss.val
                if self.monitor is not None:
                    self.monitor.__exit__(None, None, None)
        return out


def run_lerobot_train(dataset_root: str | Path, repo_id: str, *, policy_type: str = "pi05", batch: int, steps: int,
                      warmup: int, num_workers: int, dtype: str = "bfloat16", device: str = "cuda",
                      hf_home: str | Path | None = None, monitor=None, policy_options: dict | None = None,
                      **extra) -> dict:
    """Train ``policy_type`` (random init) with ``lerobot_train.train`` for ``warmup + steps`` steps; returns timings.

    ``samples_per_s`` = ``batch * steps`` over the wall time between the end of step ``warmup`` and the end of the
    last step, i.e. LeRobot's loop including data loading. ``policy_options`` set extra policy-config fields and
    ``extra`` extra ``TrainPipelineConfig`` fields (e.g. ``prefetch_factor``); ``monitor`` is a context manager
    entered for the timed window (e.g. a GPU-busy sampler). ``hf_home`` holds the tokenizer shim (a temp dir if None).
    """
    if warmup < 1 or steps < 1:
        raise ValueError("run_lerobot_train needs warmup >= 1 and steps >= 1")
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lerobot_peer_")))
        if policy_type in ("pi05", "pi0"):
            hf_home = Path(hf_home) if hf_home else tmp / "hf_home"
            paligemma_tokenizer_shim(hf_home)
            stack.enter_context(use_hf_home(hf_home))
        from lerobot.configs.default import DatasetConfig, WandBConfig
        from lerobot.configs.policies import PreTrainedConfig
        from lerobot.configs.train import TrainPipelineConfig
        from lerobot.scripts import lerobot_train
        from lerobot.utils.utils import init_logging

        policy_cls = PreTrainedConfig.get_choice_class(policy_type)
        fields = policy_cls.__dataclass_fields__
        policy_kw = {"device": device, "push_to_hub": False}
        if "dtype" in fields:
            policy_kw["dtype"] = dtype
        if "pretrained_backbone_weights" in fields:  # NOTE: random init throughout; ACT/diffusion would download.
            policy_kw["pretrained_backbone_weights"] = None
        policy_kw.update(policy_options or {})
        cfg = TrainPipelineConfig(
            dataset=DatasetConfig(repo_id=repo_id, root=str(dataset_root)), policy=policy_cls(**policy_kw),
            output_dir=tmp / "run", batch_size=batch, steps=warmup + steps, num_workers=num_workers,
            save_checkpoint=False, env_eval_freq=0, eval_steps=0, log_freq=10**9, wandb=WandBConfig(enable=False),
            **extra)
        timer = _StepTimer(lerobot_train.update_policy, warmup=warmup, steps=steps,
                           cuda=torch.device(device).type == "cuda", monitor=monitor)
        # NOTE: LeRobot's INFO log dumps the whole config at start; keep warnings only.
        stack.enter_context(_patched(lerobot_train, "init_logging", partial(init_logging, console_level="WARNING")))
        stack.enter_context(_patched(lerobot_train, "update_policy", timer))
        stack.enter_context(_patched(lerobot_train, "make_policy", _on_device(lerobot_train.make_policy, device)))
        stack.enter_context(_patched(sys, "argv", sys.argv[:1]))
        lerobot_train.train(cfg)
    if timer.t_end is None:
        raise RuntimeError(f"LeRobot ran {timer.calls} steps, expected {warmup + steps}")
    dt = timer.t_end - timer.t_start
    return {"samples_per_s": batch * steps / dt, "s_per_step": dt / steps,
            "gpu_busy_pct": getattr(monitor, "busy", None),
            "peak_mem_gib": timer.peak / 2**30 if timer.cuda else None, "params_m": timer.params / 1e6,
            "data_s": sum(timer.data_s) / steps, "update_s": sum(timer.update_s) / steps, "loss": timer.loss,
            "policy": policy_type, "num_workers": num_workers}


def _on_device(make_policy, device: str):
    """``make_policy`` with parameters created on ``device`` (same policy; only the init runs there)."""

    def build(*args, **kwargs):
        with torch.device(device):
            return make_policy(*args, **kwargs)

    return build


@contextlib.contextmanager
def _patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, help="a recorded LeRobotDataset v3 folder")
    ap.add_argument("--repo-id", default="local/pusht")
    ap.add_argument("--policy", default="pi05")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--hf-home", default=None, help="where the tokenizer shim goes (a temp dir by default)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a policy-config field (VALUE parsed as JSON if it can be), e.g. --set dim_model=64")
    args = ap.parse_args()
    options = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    logging.basicConfig(level=logging.WARNING)
    res = run_lerobot_train(args.root, args.repo_id, policy_type=args.policy, batch=args.batch, steps=args.steps,
                            warmup=args.warmup, num_workers=args.workers, dtype=args.dtype, device=args.device,
                            hf_home=args.hf_home, policy_options=options)
    print("lerobot_e2e:", json.dumps(res), flush=True)


if __name__ == "__main__":
    main()

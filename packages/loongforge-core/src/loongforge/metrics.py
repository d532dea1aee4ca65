"""Run metrics: JSONL + TensorBoard in the run directory and a progress line on the console (rank 0 only).

``metrics.jsonl`` holds one JSON object per logged step with at least ``step`` and ``loss`` — tools and tests
rely on this contract. It is strict JSON: a NaN / inf value is written as ``null``.

Rates (``*_per_s``: tokens, images, samples; and ``mfu``) are averaged over the steps since the previous logged
step, weighted by their ``step_time``: one step's ``tokens / dt`` swings with every hiccup, the interval's does not.
The ETA is the wall time per step over that interval times the steps left.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any


def _fmt_rate(value: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.1f}"


def _fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def is_rate(key: str) -> bool:
    """Metrics averaged over the logging interval (weighted by step time): throughputs and MFU."""
    return key.endswith("_per_s") or key == "mfu"


def is_logged_step(step: int, interval: int, total_steps: int | None) -> bool:
    """Whether 1-based ``step`` is recorded: every ``interval``-th, the first and the last. The same on every rank,
    so a backend may skip its host syncs (reading the loss) on the other steps."""
    return step % interval == 0 or step == total_steps or step == 1


def _drop_partial_last_line(path: Path) -> None:
    """Cut ``path`` back to its last complete line (``read_metrics`` skips a partial last line; a resumed run must
    not append after it)."""
    if not path.is_file():
        return
    with open(path, "rb+") as f:
        size = f.seek(0, 2)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        back = min(size, 1 << 20)
        f.seek(size - back)
        tail = f.read(back)
        cut = tail.rfind(b"\n")
        f.truncate(size - back + cut + 1 if cut >= 0 else (0 if back == size else size))


def _finite_or_null(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with NaN / inf floats as None: bare ``NaN`` / ``Infinity`` are not JSON (jq, pandas' strict
    readers and JavaScript refuse the line)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


class MetricsLogger:
    """Writes metrics of logged steps. Disabled (a no-op) on non-zero ranks."""

    def __init__(self, run_dir: str | Path, *, enabled: bool = True, config: Any = None, total_steps: int | None = None):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.interval = getattr(config, "interval", 1)
        self.console = getattr(config, "console", True)
        self.total_steps = total_steps
        self._jsonl = None
        self._tb = None
        self._last: tuple[float, int] | None = None  # (wall time, step) of the previous logged step
        self._window: dict[str, float] = {}  # rate key -> sum of rate * step_time since the previous logged step
        self._window_time = 0.0
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if getattr(config, "jsonl", True):
            path = self.run_dir / "metrics.jsonl"
            _drop_partial_last_line(path)  # NOTE: a crash mid-write; appending would glue the next record onto it
            self._jsonl = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        if getattr(config, "tensorboard", True):
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
            except Exception as exc:  # tensorboard missing or broken: keep training, say so once
                self.info(f"tensorboard disabled: {exc}")

    def info(self, message: str) -> None:
        """Print a console line (rank 0 only)."""
        if self.enabled and self.console:
            print(message, file=sys.stderr, flush=True)

    def should_log(self, step: int) -> bool:
        return is_logged_step(step, self.interval, self.total_steps)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record the metrics of ``step`` (1-based optimizer step)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        record = {"step": step, **{k: (float(v) if isinstance(v, int | float) else v) for k, v in metrics.items()}}
        dt = record.get("step_time")
        if isinstance(dt, float) and math.isfinite(dt) and dt > 0 and any(is_rate(k) for k in record):
            self._window_time += dt
            for key, value in record.items():
                if is_rate(key) and isinstance(value, float) and math.isfinite(value):
                    self._window[key] = self._window.get(key, 0.0) + value * dt
        evaluation = "val_loss" in record or any(k.startswith("eval/") for k in record)
        if not self.should_log(step) and not evaluation:  # evaluations are always recorded
            return
        if self._window_time > 0:
            record.update({k: v / self._window_time for k, v in self._window.items() if k in record})
        self._window, self._window_time = {}, 0.0
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(_finite_or_null(record), allow_nan=False) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, float) and math.isfinite(value):
                    # NOTE: closed-loop evaluation metrics are already named ``eval/...``
                    self._tb.add_scalar(key if key.startswith("eval/") else f"train/{key}", value, step)
        if self.console:
            self.info(self._progress_line(step, record, now))
        self._last = (now, step)

    def _progress_line(self, step: int, m: dict[str, Any], now: float) -> str:
        total = self.total_steps
        parts = [f"step {step}/{total}" if total else f"step {step}"]
        if "loss" in m:
            parts.append(f"loss {m['loss']:.4f}")
        if "val_loss" in m:
            parts.append(f"val {m['val_loss']:.4f}")
        if "lr" in m:
            parts.append(f"lr {m['lr']:.2e}")
        if "grad_norm" in m and isinstance(m["grad_norm"], float) and math.isfinite(m["grad_norm"]):
            parts.append(f"gnorm {m['grad_norm']:.3f}")
        units = [k for k in m if k.endswith("_per_s") and k != "tokens_per_s" and isinstance(m[k], float)]
        for key in units:  # NOTE: the model's own unit (images, samples) first, then tokens
            parts.append(f"{_fmt_rate(m[key])} {key[:-len('_per_s')]}/s")
        if "tokens_per_s" in m:
            parts.append(f"{_fmt_rate(m['tokens_per_s'])} tok/s")
        if "packing_efficiency" in m:
            parts.append(f"packed {100 * m['packing_efficiency']:.0f}%")
        if "dp_imbalance_before" in m and "dp_imbalance_after" in m:  # max / mean rank cost, in order -> placed
            parts.append(f"dp imbalance {m['dp_imbalance_before']:.2f}->{m['dp_imbalance_after']:.2f}")
        encoder = [m[k] for k in m if k.startswith("encoder_time_r") and isinstance(m[k], float)]
        if encoder:  # NOTE: each rank's encoder forward time (encoder hetero-DP shares the images out)
            parts.append("encoder ms/rank " + "/".join(f"{1000 * v:.0f}" for v in encoder))
        if m.get("mfu"):
            parts.append(f"MFU {100 * m['mfu']:.1f}%")
        eta = self._eta(step, m, now)
        if eta is not None:
            parts.append(f"ETA {_fmt_duration(eta)}")
        return " | ".join(parts)

    def _eta(self, step: int, m: dict[str, Any], now: float) -> float | None:
        """Seconds left: the wall time per step since the previous logged step (at the first logged step, which
        has no previous one: its own ``step_time``) times the steps left; None when unknown or done."""
        total = self.total_steps
        if not total or step >= total:
            return None
        if self._last is not None and step > self._last[1]:
            per_step = (now - self._last[0]) / (step - self._last[1])
        else:
            per_step = m.get("step_time")
            if not isinstance(per_step, float) or not math.isfinite(per_step) or per_step <= 0:
                return None
        return per_step * (total - step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of ``RUN/metrics.jsonl`` (later records for a step replace earlier ones, e.g. after resume)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        from loongforge.errors import LoongForgeError

        raise LoongForgeError(f"{path} not found: is '{run_dir}' a LoongForge run directory?")
    by_step: dict[int, dict[str, Any]] = {}
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    for i, (n, line) in enumerate(lines):
        try:
            rec = json.loads(line)
            step = int(rec["step"])
        except (ValueError, KeyError, TypeError) as exc:
            if i == len(lines) - 1:  # NOTE: a run killed mid-write leaves a partial last line: the rest is good
                break
            from loongforge.errors import LoongForgeError

            raise LoongForgeError(f"{path}:{n}: not a metrics record ({type(exc).__name__}: {exc})") from None
        by_step[step] = rec
    return [by_step[k] for k in sorted(by_step)]

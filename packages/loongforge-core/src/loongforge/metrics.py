"""Run metrics: JSONL + TensorBoard in the run directory and a progress line on the console (rank 0 only).

``metrics.jsonl`` holds one JSON object per logged step with at least ``step`` and ``loss`` — tools and tests
rely on this contract. It is strict JSON: a NaN / inf value is written as ``null``.
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
        self._start: float | None = None
        self._start_step = 0
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
        if self._start is None:
            self._start, self._start_step = now, step - 1
        record = {"step": step, **{k: (float(v) if isinstance(v, int | float) else v) for k, v in metrics.items()}}
        evaluation = "val_loss" in record or any(k.startswith("eval/") for k in record)
        if not self.should_log(step) and not evaluation:  # evaluations are always recorded
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(_finite_or_null(record), allow_nan=False) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, float) and math.isfinite(value):
                    # NOTE: closed-loop evaluation metrics are already named ``eval/...``
                    self._tb.add_scalar(key if key.startswith("eval/") else f"train/{key}", value, step)
        if self.console:
            self.info(self._progress_line(step, record, now))

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
        if "tokens_per_s" in m:
            parts.append(f"{_fmt_rate(m['tokens_per_s'])} tok/s")
        if "samples_per_s" in m:
            parts.append(f"{_fmt_rate(m['samples_per_s'])} samples/s")
        if "packing_efficiency" in m:
            parts.append(f"packed {100 * m['packing_efficiency']:.0f}%")
        if "dp_imbalance_before" in m and "dp_imbalance_after" in m:  # max / mean rank cost, in order -> placed
            parts.append(f"dp imbalance {m['dp_imbalance_before']:.2f}->{m['dp_imbalance_after']:.2f}")
        if m.get("mfu"):
            parts.append(f"MFU {100 * m['mfu']:.1f}%")
        done = step - self._start_step
        if total and done > 0 and self._start is not None:
            eta = (now - self._start) / done * (total - step)
            parts.append(f"ETA {_fmt_duration(eta)}")
        return " | ".join(parts)

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

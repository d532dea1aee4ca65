"""The harness every benchmark script runs its variants through.

A benchmark is a set of named variants (ours and a named peer, plus A/B rows) that train the same model from the
same weights on the same data. The harness

- makes the shared inputs once (the script's ``prepare(args, work)``: weights, data) in a work folder,
- runs each variant in its own process (clean memory; one crash or OOM is one row, not the end of the run), or in
  this process with ``--in-process`` (what ``--smoke`` uses, so the test suite's CPU smoke run stays cheap),
- takes the median step time after ``--warmup`` steps, the peak device memory and the losses,
- prints the table, the loss agreement of each (ours, peer) pair, and the throughput ratios last,
- appends one row per variant to the benchmark's results table, ``benchmarks/results/<name>.md``, with the date and
  the hardware (``--results DIR`` elsewhere; a ``--smoke`` run records only when ``--results`` is given).

A variant is ``fn(args) -> dict`` with ``losses`` and ``times`` (seconds per step) and ``items`` (samples or tokens
per step); optional ``peak_gib``, ``flops_per_item`` (for MFU) and any extra key a script's ``columns`` show.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PEAK_BF16 = 989e12  # H100 / H200 SXM dense bf16: the MFU denominator of every benchmark here

Variant = Callable[[argparse.Namespace], dict]


def add_args(p: argparse.ArgumentParser, *, variants: dict[str, Variant], default: str) -> None:
    """The options every benchmark has: which variants, steps, warm-up, where the table goes, smoke mode."""
    p.add_argument("--variants", default=default, help="comma-separated, of " + ", ".join(variants))
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the median")
    p.add_argument("--timeout", default="900", help="seconds per variant (child process): N, or NAME=N,... "
                   "(300 for a variant not named)")
    p.add_argument("--out", default=None, help="also write this run's report (markdown) here")
    p.add_argument("--results", default=None, help=f"folder of the results tables (default {RESULTS})")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, 2 steps, variants in this process")
    p.add_argument("--in-process", action="store_true", help="run the variants in this process (no isolation)")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)


def parse(p: argparse.ArgumentParser, argv: list[str] | None, *, smoke: dict, steps: int, warmup: int):
    """Parse ``argv``; ``--smoke`` applies the script's tiny settings ``smoke`` (over the parser's defaults only)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.argv = argv
    if args.smoke:
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
        for key, value in smoke.items():
            if key not in given:
                setattr(args, key, value)
        args.in_process = True
        steps, warmup = 2, 0
    args.steps = steps if args.steps is None else args.steps
    args.warmup = warmup if args.warmup is None else args.warmup
    return args


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    """Peak allocated device memory since :func:`reset_peak` (None on CPU: no allocator statistics)."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return None


def time_steps(step: Callable[[], float], *, steps: int, device: str) -> dict:
    """Run ``step`` (returns the loss) ``steps`` times, each timed between device syncs; losses, times, peak."""
    reset_peak(device)
    losses, times = [], []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        losses.append(float(step()))
        sync(device)
        times.append(time.perf_counter() - t0)
    return {"losses": losses, "times": times, "peak_gib": peak_gib(device)}


def job_steps(job, *, steps: int, device: str) -> dict:
    """Step a LoongForge job ``steps`` times: its losses, its own step times, the peak memory."""
    reset_peak(device)
    losses, times = [], []
    for _ in range(steps):
        m = job.step()
        losses.append(m["loss"])
        times.append(m["step_time"])
    return {"losses": losses, "times": times, "peak_gib": peak_gib(device)}


def init_sum(params) -> float:
    """The sum of ``params`` (float64) before any step: equal on two sides that start from the same weights."""
    return float(sum(p.detach().double().sum() for p in params))


def run_job(recipe: Path, overrides: list[str], *, steps: int, device: str, items: int) -> dict:
    """LoongForge's side of a policy benchmark: the job of ``recipe`` + ``overrides`` (a scratch output folder, no
    checkpoints) stepped ``steps`` times, data loading included; adds the trainable parameters (M) and their
    :func:`init_sum`."""
    from loongforge.api import build_job, load_recipe

    with tempfile.TemporaryDirectory() as tmp:
        job, _ = build_job(load_recipe(recipe, overrides), output_dir=tmp)
        try:
            start = init_sum(job.trainable)
            res = job_steps(job, steps=steps, device=device)
            res.update(trainable_m=sum(p.numel() for p in job.trainable) / 1e6, init_sum=start)
        finally:
            job.close()
    return {**res, "items": items}


def lerobot_step(policy, batch: dict, *, device: str) -> tuple[Callable[[], float], list]:
    """A LeRobot policy's training step as ``lerobot-train`` takes it (``lerobot_train.update_policy``): forward
    under bf16 autocast (on CUDA), backward, clip to the policy's preset norm, then the optimizer its config's preset
    builds over ``policy.get_optim_params()`` (as ``make_optimizer_and_scheduler`` does). Returns the step (it
    returns the loss) and the trainable parameters."""
    import torch

    preset = policy.config.get_optimizer_preset()
    opt = preset.build(policy.get_optim_params())
    params = [p for p in policy.parameters() if p.requires_grad]
    cuda = device.startswith("cuda")

    def step():
        with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
            loss, _ = policy.forward(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, preset.grad_clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, params


def save_perturbed_diffusers(model_cls, config: dict, *, device: str, out: Path) -> None:
    """A random-init diffusers ``model_cls`` of ``config`` (keys starting "_" dropped) saved to ``out`` (bf16 on
    CUDA, fp32 otherwise), every weight perturbed like the tests: diffusers zero-initialises some projections, and a
    zero gate would hide a wrong path from the loss comparison."""
    import torch

    cfg = {k: v for k, v in config.items() if not k.startswith("_")}
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(**cfg)
    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            base = 1.0 if "norm" in n and n.endswith("weight") else 0.0
            p.copy_(0.02 * torch.randn(p.shape, generator=g, device=device) + base)
    model.to(torch.bfloat16 if device == "cuda" else torch.float32).save_pretrained(out)


def hardware(device: str) -> str:
    """What ran it: the GPU's name and count, or the CPU."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        n = torch.cuda.device_count()
        return torch.cuda.get_device_name() + (f" x{n}" if n > 1 else "")
    return f"CPU ({platform.machine()})"


def loss_diff(a: list[float], b: list[float]) -> float:
    """Max relative difference of two loss curves over their common steps."""
    n = min(len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a[:n], b[:n], strict=True))


@dataclass
class Bench:
    """One benchmark: its results table's name, the script, its variants and how a row reads."""

    name: str
    script: str
    variants: dict[str, Variant]
    unit: str  # what ``items`` counts, per second: "tokens/s", "images/s", "samples/s"
    pairs: list[tuple[str, str]] = field(default_factory=list)  # (ours, peer): loss agreement + ratio
    columns: dict[str, Callable[[dict], str]] = field(default_factory=dict)  # extra columns of the report
    notes: Callable[[dict[str, dict]], list[str]] | None = None  # lines after the table (what the columns can't say)
    ratios: bool = True  # False where the rates are not comparable (variants that ran side by side)

    def main(self, args: argparse.Namespace, *, setup: str, device: str,
             prepare: Callable[[argparse.Namespace, Path], None] | None = None,
             run_all: Callable[[argparse.Namespace, list[str]], dict[str, dict]] | None = None) -> dict[str, dict]:
        """Run (or, in a child, be) the variants; print the report, ratios last; append the results rows.
        ``run_all(args, names)``, if given, runs the variants its own way (e.g. side by side) and returns results."""
        if args.variant:  # a child process: one variant, its result as JSON
            Path(args.json).write_text(json.dumps(self._call(args.variant, args)))
            return {}
        unknown = [v for v in args.variants.split(",") if v not in self.variants]
        if unknown:
            raise SystemExit(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(self.variants)})")
        args.work = args.work or tempfile.mkdtemp(prefix=f"{self.name}-")
        if prepare is not None:
            prepare(args, Path(args.work))
        hw = hardware(device)
        rows: dict[str, dict] = {}
        names = args.variants.split(",")
        done = run_all(args, names) if run_all is not None else {}
        for name in names:
            t0 = time.time()
            res = done.get(name) or (self._call(name, args) if args.in_process else self._child(name, args))
            res.setdefault("wall_s", time.time() - t0)
            rows[name] = self._summarise(res, args.warmup)
            print(name, {k: v for k, v in rows[name].items() if k not in ("losses", "times", "profile")}, flush=True)
            if args.out:  # NOTE: after every variant, so a timeout keeps the rows measured so far
                _write(args.out, self.report(rows, setup=setup, hardware=hw, args=args))
        text = self.report(rows, setup=setup, hardware=hw, args=args)
        print(text, flush=True)
        if args.out:
            _write(args.out, text)
        results = args.results or (None if args.smoke else RESULTS)
        if results:
            self.append(Path(results), rows, setup=setup, hardware=hw)
        return rows

    def _call(self, name: str, args: argparse.Namespace) -> dict:
        args.variant_name = name
        try:
            return self.variants[name](args)
        except Exception as exc:  # OOM or a failure: one row says so, the other variants still run
            traceback.print_exc()
            return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}

    def child_command(self, name: str, args: argparse.Namespace) -> list[str]:
        """The command that runs variant ``name`` in its own process; it writes ``<work>/<name>.json``."""
        js = Path(args.work) / f"{name}.json"
        return [sys.executable, self.script, *args.argv, "--variant", name, "--json", str(js), "--work", args.work]

    @staticmethod
    def child_result(name: str, args: argparse.Namespace) -> dict:
        js = Path(args.work) / f"{name}.json"
        return json.loads(js.read_text()) if js.is_file() else {"error": "no result (crashed or timed out)"}

    def _child(self, name: str, args: argparse.Namespace) -> dict:
        cmd = self.child_command(name, args)
        spec = str(args.timeout)
        timeout = float(dict(kv.split("=") for kv in spec.split(",")).get(name, 300)) if "=" in spec else float(spec)
        try:
            subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        return self.child_result(name, args)

    @staticmethod
    def _summarise(res: dict, warmup: int) -> dict:
        if res.get("times"):
            t = statistics.median(res["times"][min(warmup, len(res["times"]) - 1):])
            res["step_s"] = t
            res["rate"] = res["items"] / t
            if res.get("flops_per_item"):
                res["mfu"] = res["rate"] * res["flops_per_item"] / PEAK_BF16
        return res

    def _cells(self, r: dict) -> list[str]:
        if "error" in r:
            return [r["error"], "", "", "", *("" for _ in self.columns)]
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else ""
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else ""
        loss = f"{r['losses'][0]:.4f} → {r['losses'][-1]:.4f}"
        return [f"{r['rate']:,.1f}", mfu, peak, loss, *(fmt(r) for fmt in self.columns.values())]

    def report(self, rows: dict[str, dict], *, setup: str, hardware: str, args: argparse.Namespace) -> str:
        """This run's table, the loss agreement of each pair, the ratios last."""
        head = ["variant", self.unit, "MFU", "peak GiB", "loss first → last", *self.columns]
        lines = [f"# {self.name} — {hardware}, {time.strftime('%Y-%m-%d')}", "", setup,
                 f"{args.steps} steps, median step time after {args.warmup} warm-up steps; MFU against "
                 f"{PEAK_BF16 / 1e12:.0f} TFLOP/s dense bf16.", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += [f"| {name} | " + " | ".join(self._cells(r)) + " |" for name, r in rows.items()]
        if self.notes is not None:
            lines += ["", *self.notes(rows)]
        agree, ratios = [], []
        for ours, peer in self.pairs:
            a, b = rows.get(ours, {}), rows.get(peer, {})
            if a.get("losses") and b.get("losses") and a.get("items") == b.get("items"):
                agree.append(f"Loss of {ours} vs {peer}: max relative difference {loss_diff(a['losses'], b['losses']):.2e} "
                             f"over {min(len(a['losses']), len(b['losses']))} steps.")
            if self.ratios and "rate" in a and "rate" in b:
                ratios.append(f"{ours} / {peer}: {a['rate'] / b['rate']:.2f}x")
        for name, r in rows.items():
            if r.get("profile"):
                lines += ["", f"## Profile of {name}", "", "```", r["profile"], "```"]
        return "\n".join(lines + [""] + agree + [""] + ratios)

    def append(self, folder: Path, rows: dict[str, dict], *, setup: str, hardware: str) -> Path:
        """Add this run's rows to ``folder/<name>.md`` (made with its header on first use)."""
        head = ["setup", "variant", self.unit, "MFU", "peak GiB", "loss first → last", *self.columns]
        cells = [[setup, name, *self._cells(r)] for name, r in rows.items()]
        return append_rows(folder / f"{self.name}.md", script=self.script, head=head, rows=cells, hardware=hardware)


def append_rows(path: Path, *, script: str, head: list[str], rows: list[list[str]], hardware: str) -> Path:
    """Append ``rows`` to the results table at ``path``, each after today's date and ``hardware`` (the file and its
    header are made on first use): re-runs add rows, so a table holds a benchmark's history."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file():
        cols = ["date", "hardware", *head]
        path.write_text(f"# {path.stem}\n\nOne row per result per run of `benchmarks/{Path(script).name}`; newest last."
                        "\n\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
    date = time.strftime("%Y-%m-%d")
    with path.open("a") as f:
        for row in rows:
            f.write(f"| {date} | {hardware} | " + " | ".join(str(c).replace("|", "/") for c in row) + " |\n")
    return path


def _write(path: str, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text + "\n")

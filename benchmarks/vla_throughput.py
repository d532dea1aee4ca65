"""VLA training throughput on one GPU: LoongForge's embodied trainer vs LeRobot 0.6.1 (named peer), two ways.

All train a pi05-shaped, randomly initialised policy in bf16 with AdamW + grad clip at the same batch size.
Ours: the ``embodied`` backend's job on the ``pi05`` preset, data loading included (DataLoader workers, pinned
memory; synthetic frames, or the recorded dataset given by ``--data-root``), stepped as ``loongforge train`` steps it:
the loss is read (a host sync) only on the steps the recipe logs (``logging.interval``).
Peers: ``lerobot_step``, the model step alone: ``PI05Policy`` stepped the way ``lerobot-train`` does
(bf16 autocast forward → backward → clip → step) on a synthetic batch already on the GPU; ``lerobot_e2e`` (only with
``--data-root``), LeRobot's own loop end to end: ``lerobot_train.train`` on the same recorded dataset, data loading
and preprocessing included (see ``lerobot_peer.py``). Prints samples/s, GPU busy % (if pynvml is present) and the
ratios last (with ``--data-root`` ours includes data loading in both ratios); appends a JSON line to
``benchmarks/results/vla_throughput_<policy>_<gpu>.jsonl`` (one file per policy and GPU; each record has its date;
``--only`` pairs a side with the other side's latest record there) and a row per side to
``benchmarks/results/vla_throughput.md`` (see ``harness.py``).

    uv run python benchmarks/vla_throughput.py --batch 16 --steps 30                       # ours vs lerobot_step
    uv run python benchmarks/vla_throughput.py --batch 16 --data-root .vla_data/pusht224   # + lerobot_e2e
    uv run python benchmarks/vla_throughput.py --only ours --batch 32                      # our side alone
    uv run python benchmarks/vla_throughput.py --smoke       # CPU, tiny_vla's tiny preset, ours, 2 steps
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import harness
import torch

ROOT = Path(__file__).resolve().parents[1]


class BusySampler:
    """Samples ``torch.cuda.utilization()`` every 100 ms (None when NVML is unavailable)."""

    def __init__(self):
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                self.samples.append(torch.cuda.utilization())
            except Exception:
                return
            time.sleep(0.1)

    def __enter__(self):
        if torch.cuda.is_available():
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def busy(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


def bench_lerobot_step(*, batch: int, steps: int, warmup: int, cameras: int = 2) -> dict:
    """The model step alone: LeRobot's PI05Policy, random init, bf16, synthetic batch on the GPU."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    cams = ["observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb",
            "observation.images.right_wrist_0_rgb"][:cameras]
    feats = {k: PolicyFeature(type=FeatureType.VISUAL, shape=(3, 224, 224)) for k in cams}
    feats["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(32,))
    cfg = PI05Config(device="cuda", dtype="bfloat16", input_features=feats,
                     output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(32,))})
    t0 = time.time()
    with torch.device("cuda"):  # NOTE: random init of 4.1B parameters on the device CPU alone took minutes
        policy = PI05Policy(cfg)
    policy = policy.cuda().train()
    print(f"lerobot_step: policy built in {time.time() - t0:.0f} s", flush=True)
    opt = torch.optim.AdamW(policy.parameters(), lr=2.5e-5, weight_decay=0.01)
    dev = torch.device("cuda")
    b = {k: torch.rand(batch, 3, 224, 224, device=dev) for k in cams}
    b.update({"observation.state": torch.randn(batch, 32, device=dev), "action": torch.randn(batch, 50, 32, device=dev),
              "observation.language.tokens": torch.randint(0, 257152, (batch, 200), device=dev),
              "observation.language.attention_mask": torch.ones(batch, 200, dtype=torch.bool, device=dev)})

    def step():
        # NOTE: lerobot_train.update_policy runs forward under accelerator.autocast(), which is bf16 autocast when
        # policy.dtype is bfloat16 (LeRobot 0.6.1); without it the fp32-kept parts (SigLIP, norms) run in fp32.
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = policy.forward(b)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {**_time(step, batch=batch, steps=steps, warmup=warmup,
                    params=sum(p.numel() for p in policy.parameters())), "autocast": "bf16"}


def bench_lerobot_e2e(*, data_root: str, repo_id: str, batch: int, steps: int, warmup: int, workers: int) -> dict:
    """LeRobot's own loop end to end (``lerobot_train.train``, pi05, bf16) on the recorded dataset."""
    from lerobot_peer import run_lerobot_train

    return run_lerobot_train(data_root, repo_id, policy_type="pi05", batch=batch, steps=steps, warmup=warmup,
                             num_workers=workers, dtype="bfloat16", device="cuda", monitor=BusySampler())


# Our policies at pi05 size: ``lerobot_pi05`` is LeRobot's own PI05Pytorch (the same model as the peers),
# ``tiny_vla`` our pi05-shaped re-implementation; any other policy name overrides tiny_vla's recipe.
OUR_RECIPES = {"lerobot_pi05": "lerobot_pi05_synthetic.yaml", "tiny_vla": "tiny_vla_synthetic.yaml"}


def bench_ours(*, batch: int, steps: int, warmup: int, compile: bool, workers: int, data_root: str | None,
               policy: str = "lerobot_pi05", recompute: bool = False, profile: bool = False,
               compile_mode: str = "default", prompt_padding: str = "max_length", tokenizer: str = "",
               preset: str = "pi05", device: str = "cuda") -> dict:
    from loongforge.api import build_job, load_recipe
    from loongforge.metrics import is_logged_step

    over = [f"train.steps={steps + warmup}", f"train.global_batch_size={batch}", f"train.micro_batch_size={batch}",
            f"train.precision={'bf16' if device == 'cuda' else 'fp32'}", f"model.preset={preset}",
            f"accelerator={device}", "train.warmup_steps=0", f"train.compile={str(compile).lower()}",
            f"train.compile_mode={compile_mode}",
            f"data.num_workers={workers}", "checkpoint.resume=never", "checkpoint.save_at_end=false",
            "logging.console=false", "logging.tensorboard=false", f"data.synthetic_samples={batch * 64}",
            f"parallel.recompute={'full' if recompute else 'none'}"]
    if data_root:
        over += ["data.format=lerobot", f"data.root={data_root}"]
    if policy not in OUR_RECIPES:
        over.append(f"model.policy={policy}")
    if policy == "lerobot_pi05":
        over += [f"model.arch.prompt_padding={prompt_padding}", f"model.arch.tokenizer={tokenizer}"]
    recipe = load_recipe(ROOT / "recipes" / "embodied" / OUR_RECIPES.get(policy, "tiny_vla_synthetic.yaml"), over)
    with tempfile.TemporaryDirectory() as tmp:
        job, _ = build_job(recipe, output_dir=tmp)
        interval, calls = recipe.logging.interval, iter(range(1, 1 << 30))

        def step():  # NOTE: as `loongforge train` runs it: only the steps the recipe logs read the loss
            return job.step(report=is_logged_step(next(calls), interval, recipe.train.steps))

        try:
            res = {**_time(step, batch=batch, steps=steps, warmup=warmup, device=device,
                           params=sum(p.numel() for p in job.model.raw.parameters())),
                   "policy": recipe.model.policy, "recompute": recompute, "log_interval": interval,
                   "compile_mode": compile_mode, "prompt_padding": prompt_padding, "tokenizer": tokenizer or "bytes"}
            if profile:
                _profile(step)
            return res
        finally:
            job.close()


def _profile(step, steps: int = 2) -> None:
    """Kernel time and host time of ``steps`` more steps: the top kernels (where the GPU time goes) and the top
    host operators by their own CPU time (what keeps the GPU waiting when it is not busy)."""
    from torch.profiler import ProfilerActivity, profile

    step()  # NOTE: no sync before the trace starts: the GPU is still busy with this step, as in training
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    _gaps(prof, steps)
    table = prof.key_averages()
    print(table.table(sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=110), flush=True)
    print(table.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=80), flush=True)


def _gaps(prof, steps: int) -> None:
    """Where the GPU waits: from the trace's device events (kernels, copies, memsets), the busy time, the span and
    the idle gaps (> 2 us) per step, with the kernels the largest gaps come after and before."""
    import bisect
    import collections

    path = os.path.join(tempfile.gettempdir(), "vla_trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    dev = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    if not dev:
        print("[gaps] no device events in the trace", flush=True)
        return
    busy = sum(e["dur"] for e in dev)
    span = dev[-1]["ts"] + dev[-1]["dur"] - dev[0]["ts"]
    after, before, gaps, end = collections.Counter(), collections.Counter(), [], dev[0]["ts"] + dev[0]["dur"]
    t0, bins = dev[0]["ts"], [0.0] * 40  # idle time over the span in 40 slices: where in the step the GPU waits
    prev = dev[0]
    for e in dev[1:]:
        gap = e["ts"] - end
        if gap > 2:
            gaps.append(gap)
            after[prev["name"][:70]] += gap
            before[e["name"][:70]] += gap
            bins[min(39, int((end - t0) / span * 40))] += gap
        if e["ts"] + e["dur"] >= end:
            end, prev = e["ts"] + e["dur"], e
    print(f"[gaps] per step: device busy {busy / steps / 1e3:.1f} ms, span {span / steps / 1e3:.1f} ms, idle "
          f"{sum(gaps) / steps / 1e3:.1f} ms in {len(gaps) // steps} gaps > 2 us, {len(dev) // steps} device events (largest {max(gaps, default=0) / 1e3:.2f} ms)",
          flush=True)
    print("[gaps] idle us per 1/40 of the span: " + " ".join(f"{b:.0f}" for b in bins), flush=True)
    edges = (2, 5, 20, 100, 1000, float("inf"))
    hist = [[0, 0.0] for _ in edges[1:]]
    for g in gaps:
        i = next(k for k in range(len(edges) - 1) if g <= edges[k + 1])
        hist[i][0] += 1
        hist[i][1] += g
    sizes = [f"{lo}-{hi}us: {n // steps}, {t / steps / 1e3:.2f}"
             for lo, hi, (n, t) in zip(edges, edges[1:], hist, strict=False)]
    print("[gaps] by size (count, ms per step): " + "  ".join(sizes), flush=True)
    # NOTE: what the host was doing while the GPU waited (the innermost host op spanning each gap > 20 us)
    host = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation",
                                                                              "python_function", "cuda_runtime")),
                  key=lambda e: e["ts"])
    starts = [e["ts"] for e in host]
    doing = collections.Counter()
    end = dev[0]["ts"] + dev[0]["dur"]
    for e in dev[1:]:
        if e["ts"] - end > 20:
            mid = (e["ts"] + end) / 2
            spanning = [h for h in host[max(0, bisect.bisect_right(starts, mid) - 400):bisect.bisect_right(starts, mid)]
                        if h["ts"] + h["dur"] >= mid]
            inner = min(spanning, key=lambda h: h["dur"], default=None)
            doing[inner["name"][:70] if inner else "(no host op)"] += e["ts"] - end
        end = max(end, e["ts"] + e["dur"])
    print("[gaps] host op running during gaps > 20 us (ms per step):", flush=True)
    for name, us in doing.most_common(15):
        print(f"[gaps]   {us / steps / 1e3:7.2f}  {name}", flush=True)
    for title, counter in (("after", after), ("before", before)):
        print(f"[gaps] idle time by the kernel it comes {title} (ms per step):", flush=True)
        for name, us in counter.most_common(12):
            print(f"[gaps]   {us / steps / 1e3:7.2f}  {name}", flush=True)


def _time(step, *, batch: int, steps: int, warmup: int, params: int, device: str = "cuda") -> dict:
    for _ in range(warmup):
        step()
    harness.sync(device)
    harness.reset_peak(device)
    with BusySampler() as busy:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        harness.sync(device)
        dt = time.perf_counter() - t0
    return {"samples_per_s": batch * steps / dt, "s_per_step": dt / steps, "gpu_busy_pct": busy.busy,
            "peak_mem_gib": harness.peak_gib(device), "params_m": params / 1e6}


def _num_cameras(data_root: str) -> int:
    feats = json.loads((Path(data_root) / "meta" / "info.json").read_text())["features"]
    return sum(f["dtype"] in ("image", "video") for f in feats.values())


def merge_earlier(log: Path, res: dict) -> tuple[dict, dict]:
    """``res`` plus the sides it lacks from the latest earlier records of the same setup in ``log`` (which ends
    with ``res`` itself), and the time of the run each borrowed side comes from."""
    same = ("date", "batch", "data_root", "workers", "compile", "compile_mode", "policy", "recompute", "prompt_padding",
            "tokenizer")
    merged, paired = dict(res), {}
    for line in log.read_text().splitlines()[:-1]:
        rec = json.loads(line)
        if all(rec.get(k) == res.get(k) for k in same):
            for k in ("ours", "lerobot_step", "lerobot_e2e"):
                if k in rec and k not in res:
                    merged[k], paired[k] = rec[k], rec.get("time", "?")
    return merged, paired


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--only", choices=["ours", "peer", "lerobot_step", "lerobot_e2e"], default=None,
                    help="one side only ('peer': both LeRobot peers)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--compile-mode", default="default",
                    choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                    help="ours: train.compile_mode (reduce-overhead: CUDA graphs per compiled unit)")
    ap.add_argument("--workers", type=int, default=6, help="DataLoader workers, ours and lerobot_e2e")
    ap.add_argument("--data-root", default=None, help="a recorded LeRobotDataset instead of synthetic frames")
    ap.add_argument("--repo-id", default=None, help="the dataset's repo id for LeRobot (default local/<folder>)")
    ap.add_argument("--policy", default="lerobot_pi05", help="ours: lerobot_pi05 (LeRobot's PI05Pytorch) | tiny_vla")
    ap.add_argument("--recompute", action="store_true", help="ours: activation checkpointing (parallel.recompute=full)")
    ap.add_argument("--profile", action="store_true", help="ours: print a CUDA kernel profile of two more steps")
    ap.add_argument("--prompt-padding", choices=["longest", "max_length"], default=None,
                    help="ours (lerobot_pi05): model.arch.prompt_padding; default longest with --data-root (both "
                         "sides tokenize the same prompts; LeRobot pads them to 200), max_length on synthetic "
                         "batches (lerobot_step feeds 200 valid random tokens)")
    ap.add_argument("--tokenizer", choices=["shim", "bytes"], default="shim",
                    help="ours (lerobot_pi05): the PaliGemma tokenizer stand-in LeRobot's loop loads "
                         "(lerobot_peer.paligemma_tokenizer_shim), or Gemma byte-fallback tokens")
    ap.add_argument("--preset", default="pi05", help="ours: model.preset")
    ap.add_argument("--results", default=None, help=f"folder of the results tables (default {harness.RESULTS})")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny_vla's tiny preset, ours only, 2 steps")
    args = ap.parse_args(argv)
    device = "cuda"
    if args.smoke:
        device = "cpu"
        args.policy, args.preset, args.batch, args.steps, args.warmup, args.workers = "tiny_vla", "tiny", 2, 2, 0, 0
        args.only, args.tokenizer = "ours", "bytes"
    elif not torch.cuda.is_available():
        raise SystemExit("vla_throughput needs a CUDA GPU (or --smoke)")
    if args.only == "lerobot_e2e" and not args.data_root:
        raise SystemExit("--only lerobot_e2e needs --data-root")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    padding = args.prompt_padding or ("longest" if args.data_root else "max_length")
    run = {"ours": args.only in (None, "ours"), "lerobot_step": args.only in (None, "peer", "lerobot_step"),
           "lerobot_e2e": bool(args.data_root) and args.only in (None, "peer", "lerobot_e2e")}
    res: dict = {"batch": args.batch, "gpu": harness.hardware(device), "compile": args.compile,
                 "compile_mode": args.compile_mode, "data_root": args.data_root, "workers": args.workers, "policy": args.policy,
                 "recompute": args.recompute, "prompt_padding": padding, "tokenizer": args.tokenizer,
                 "time": time.strftime("%H:%M:%S")}
    if run["ours"]:
        with tempfile.TemporaryDirectory(prefix="tok_shim_") as hf_home:
            tokenizer = ""
            if args.tokenizer == "shim":
                from lerobot_peer import paligemma_tokenizer_shim

                tokenizer = str(paligemma_tokenizer_shim(hf_home))
            res["ours"] = bench_ours(batch=args.batch, steps=args.steps, warmup=args.warmup, compile=args.compile,
                                     workers=args.workers, data_root=args.data_root, policy=args.policy,
                                     recompute=args.recompute, profile=args.profile, compile_mode=args.compile_mode,
                                     prompt_padding=padding, tokenizer=tokenizer, preset=args.preset,
                                     device=device)
        print("ours:", json.dumps(res["ours"]), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    if run["lerobot_step"]:
        # NOTE: as many cameras as ours sees: the recorded dataset's, else the pi05 preset's two.
        res["lerobot_step"] = bench_lerobot_step(batch=args.batch, steps=args.steps, warmup=args.warmup,
                                                 cameras=_num_cameras(args.data_root) if args.data_root else 2)
        print("lerobot_step:", json.dumps(res["lerobot_step"]), flush=True)
        torch.cuda.empty_cache()
    if run["lerobot_e2e"]:
        # NOTE: last, since lerobot_train.train sets process-wide torch flags (cudnn.benchmark, tf32) and logging.
        repo_id = args.repo_id or f"local/{Path(args.data_root).name}"
        res["lerobot_e2e"] = bench_lerobot_e2e(data_root=args.data_root, repo_id=repo_id, batch=args.batch,
                                               steps=args.steps, warmup=args.warmup, workers=args.workers)
        print("lerobot_e2e:", json.dumps(res["lerobot_e2e"]), flush=True)
    results = Path(args.results) if args.results else (None if args.smoke else harness.RESULTS)
    res = {"date": time.strftime("%Y-%m-%d"), **res}
    if results is None:
        return res
    setup = (f"{res['policy']} {args.preset}, batch {args.batch}, {'compile ' + args.compile_mode if args.compile else 'eager'}"
             f", {'recorded data' if args.data_root else 'synthetic data'}")
    harness.append_rows(results / "vla_throughput.md", script=__file__, hardware=res["gpu"], head=[
        "setup", "side", "samples/s", "GPU busy %", "peak GiB"], rows=[
        [setup, side, f"{r['samples_per_s']:.1f}", f"{r['gpu_busy_pct']:.0f}" if r.get("gpu_busy_pct") else "",
         f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else ""]
        for side, r in res.items() if side in ("ours", "lerobot_step", "lerobot_e2e")])
    gpu = res["gpu"].lower().removeprefix("nvidia ").replace(" ", "-")
    log = results / f"vla_throughput_{args.policy.removeprefix('lerobot_')}_{gpu}.jsonl"
    with open(log, "a") as f:
        f.write(json.dumps(res) + "\n")
    # NOTE: with --only, the other side comes from the latest earlier record of the same setup of today in the file
    # (the e2e sides run as two processes of one command, each needing the whole GPU).
    merged, paired = merge_earlier(log, res) if args.only else (dict(res), {})
    for peer, what in (("lerobot_e2e", "end to end"), ("lerobot_step", "model step")):
        if "ours" in merged and peer in merged:
            ratio = merged["ours"]["samples_per_s"] / merged[peer]["samples_per_s"]
            earlier = "; ".join(f"{k} from the run at {t}" for k, t in paired.items() if k in ("ours", peer))
            print(f"ratio {what} ours/{peer}: {ratio:.2f}x ({merged['ours']['samples_per_s']:.1f} vs "
                  f"{merged[peer]['samples_per_s']:.1f} samples/s, batch {res['batch']}"
                  + (f"; {earlier})" if earlier else ")"))
    return res


if __name__ == "__main__":
    main()

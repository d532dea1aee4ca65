"""ddp, zero1, fsdp2 and hsdp (2×1 mesh) on 2 gloo processes match the single-process losses over 5 steps
(tiny_vla); ddp and fsdp2 for the GR00T-style policy (its recipe freezes the backbone: those blocks stay
unsharded).

Tolerance: |Δloss| ≤ 1e-5 relative (fp32; the only difference is reduction order — observed ~1e-7). Both runs
use global batch 8 with micro-batch 2: 4 accumulated micro-batches on one rank, 2 on each of two. The
one-process reference runs inside the test process.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loongforge.runtime import free_port

DRIVER = Path(__file__).with_name("dist_driver.py")
CASES = {  # recipe -> strategies run on 2 processes
    "tiny_vla_synthetic.yaml": ["ddp", "zero1", "fsdp2", "hsdp:1"],
    "tiny_groot_synthetic.yaml": ["ddp", "fsdp2"],
}
RTOL = 1e-5
STEPS = 5


def _run(nproc: int, out: Path, env: dict, recipe: str, specs: list[str]) -> dict[str, list[float]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", str(DRIVER), str(out), str(STEPS), recipe, *specs]
    # NOTE: the timeout is the deadlock watchdog: a hung collective fails the test instead of CI.
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


# NOTE: how each strategy holds a weight on 2 ranks: equal losses alone would not tell hsdp's 2x1 mesh (replicate
# over 2, shard over 1) from ddp or a 1-D fsdp2 mesh.
LAYOUTS = {
    "ddp": {}, "zero1": {},
    "fsdp2": {"mesh": [2], "names": ["dp"], "placements": ["S(0)"]},
    "hsdp:1": {"mesh": [2, 1], "names": ["replicate", "shard"], "placements": ["R", "S(0)"]},
}


def _single_process(recipe: str) -> list[float]:
    """The one-process reference, run in this process (saves a process start: imports dominate on CPU)."""
    spec = importlib.util.spec_from_file_location("dist_driver", DRIVER)
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: as in the ranks (conftest): more threads make tiny matmuls far slower
    try:
        return driver.losses(recipe, "ddp", steps=STEPS)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(CASES))
def test_strategies_match_single_process(recipe, tmp_path, env):
    single = _single_process(recipe)
    multi = _run(2, tmp_path / "two.json", env, recipe, CASES[recipe])
    for spec in CASES[recipe]:
        assert multi["losses"][spec] == pytest.approx(single, rel=RTOL), f"{spec}: {multi['losses'][spec]} vs {single}"
        assert multi["layouts"][spec] == LAYOUTS[spec], spec

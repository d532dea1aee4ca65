"""The example under examples/ drives a real backend through the public API only.

NOTE: it runs in a subprocess: an in-process megatron job leaves megatron-core's module-level process-group state
behind, and tests that later fork ranks from the pytest process would inherit it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "library_use.py"


def test_library_example_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "losses [" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in records)

"""The example under examples/ drives a real backend through the public API only."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "library_use.py"


def test_library_example_runs(tmp_path):
    spec = importlib.util.spec_from_file_location("library_use", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    losses = module.main(tmp_path, steps=2)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert (tmp_path / "run" / "metrics.jsonl").is_file()

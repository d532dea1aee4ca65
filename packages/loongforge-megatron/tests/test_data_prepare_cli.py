"""``loongforge data prepare`` on the quickstart recipe, as a user runs it: the prepared files exist and stderr
carries our progress lines, not megatron-core's import-time notices about TransformerEngine / Apex / CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "quickstart" / "llama_stdlib.yaml"


def test_data_prepare_prints_no_megatron_import_notices(tmp_path):
    out = tmp_path / "data"
    proc = subprocess.run(
        [sys.executable, "-m", "loongforge", "data", "prepare", str(RECIPE), f"data.path={out}",
         "data.source.max_bytes=100000", "data.train_tokenizer.vocab_size=512"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("prepared.json", "train.bin", "train.idx", "tokenizer/tokenizer.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "prepared.json").read_text())
    for noise in ("Transformer Engine", "Apex", "No CUDA runtime"):
        assert noise not in proc.stderr, proc.stderr
    assert "[data]" in proc.stderr  # our own progress lines still come through

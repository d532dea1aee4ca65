"""The README's main command: the quickstart recipe trains on CPU in minutes, loss falls by >= 40% from step 1,
and the HF export loads and generates with transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart" / "llama_stdlib.yaml"


def test_quickstart_trains_and_exports(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "loongforge", "train", str(RECIPE), "--output", str(tmp_path / "run"), "accelerator=cpu"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    elapsed = time.time() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, last = records[0], records[-1]
    assert first["step"] == 1 and last["step"] == 150
    drop = 1 - last["loss"] / first["loss"]
    print(f"quickstart: {elapsed:.0f}s, loss {first['loss']:.3f} -> {last['loss']:.3f} ({100 * drop:.0f}% lower)")
    assert drop >= 0.40, (first["loss"], last["loss"])
    assert elapsed < 300, f"quickstart took {elapsed:.0f}s (budget: 5 minutes on 2 CPU cores)"

    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = tmp_path / "run" / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf)
    tok = AutoTokenizer.from_pretrained(hf)
    out = model.generate(**tok("def ", return_tensors="pt"), max_new_tokens=24, do_sample=False)
    text = tok.decode(out[0])
    print(repr(text))
    assert len(out[0]) > 10 and text.startswith("def ")

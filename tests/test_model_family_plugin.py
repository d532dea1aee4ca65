"""A model family from another package: ``examples/megatron-phi3`` installs with ``uv pip`` (as docs/models.md
says) into a temporary venv beside the workspace's packages (no index, no download), ``loongforge plugins`` lists
it under ``loongforge.megatron.models``, and its tiny recipe trains through ``loongforge train`` from an HF Phi-3
that transformers saved, exporting an HF directory that transformers loads with every tensor where it belongs."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "megatron-phi3"

# run in the venv: a tiny Phi-3 saved by transformers itself
SAVE = """
import sys, torch, transformers as tf
torch.manual_seed(0)
cfg = tf.Phi3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
tf.Phi3ForCausalLM(cfg).save_pretrained(sys.argv[1])
"""
# run in the venv: the export loads into transformers' Phi3ForCausalLM with no missing / unexpected tensor, and each
# tensor is the source's moved by two small optimizer steps (a permuted q/k/v or gate/up would be far off)
CHECK = """
import sys, torch, transformers as tf
src = tf.AutoModelForCausalLM.from_pretrained(sys.argv[1])
out, info = tf.AutoModelForCausalLM.from_pretrained(sys.argv[2], output_loading_info=True)
assert type(out).__name__ == "Phi3ForCausalLM", type(out)
assert not info["missing_keys"] and not info["unexpected_keys"], info
a, b = src.state_dict(), out.state_dict()
assert a.keys() == b.keys()
moved = {k: (a[k] - b[k]).abs().max().item() for k in a}
assert max(moved.values()) < 0.01, sorted(moved.items(), key=lambda kv: -kv[1])[:3]
assert moved["model.layers.0.self_attn.qkv_proj.weight"] > 0 and moved["model.layers.1.mlp.gate_up_proj.weight"] > 0
print("ok")
"""


def _run(cmd: list[str], *, ok: bool = True, **kw) -> subprocess.CompletedProcess | str:
    """``cmd``'s stdout, asserting it succeeded (``ok=False``: the finished process, whatever it returned)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "PIP_NO_INDEX": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, **kw)
    if not ok:
        return proc
    assert proc.returncode == 0, (cmd, proc.stdout[-2000:], proc.stderr[-4000:])
    return proc.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv that sees the workspace's installed packages (its site dir added, editable installs too) and
    has the example installed into it alone: ``uv pip install --offline --no-deps``."""
    root = tmp_path_factory.mktemp("plugin")
    env = root / "venv"
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    # NOTE: uv's venv has no pip to bootstrap (python -m venv spends seconds on ensurepip)
    _run([uv, "venv", "-q", str(env), "--python", sys.executable])
    py = env / "bin" / "python"
    ours = _run([str(py), "-c", "import site; print(site.getsitepackages()[0])"]).strip()
    # NOTE: an `import` line of a .pth runs at startup: addsitedir also reads the workspace's own .pth files
    # (the editable installs of loongforge-core / -megatron)
    (Path(ours) / "_workspace.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n"
                                                       for d in site.getsitepackages()))
    src = root / "src"
    shutil.copytree(EXAMPLE, src)  # NOTE: setuptools writes egg-info next to the sources: not into the checkout
    _run([uv, "pip", "install", "-q", "--offline", "--no-deps", "--no-build-isolation", "--python", str(py), str(src)])
    return env


def test_an_installed_family_is_listed_and_trains_with_hf_in_and_out(venv, tmp_path):
    py = str(venv / "bin" / "python")
    listing = _run([py, "-m", "loongforge", "plugins"])
    group = listing.split("loongforge.megatron.models", 1)[1]
    line = next(ln for ln in group.splitlines() if ln.strip().startswith("phi3 "))
    assert "loongforge-phi3" in line and "[ok]" in line, line
    assert "llama " in group and "dit " in group  # the backend's own families, through the same group

    hf_in = tmp_path / "hf_in"
    _run([py, "-c", SAVE, str(hf_in)])
    recipe = _run([py, "-c", "import loongforge_phi3; print(loongforge_phi3.RECIPE)"]).strip()
    run = tmp_path / "run"
    _run([py, "-m", "loongforge", "train", recipe, "--output", str(run), "model.preset=null", f"model.hf={hf_in}",
          f"checkpoint.load={hf_in}", "train.stage=cpt", "train.steps=2", "logging.console=false"])
    assert (run / "hf" / "config.json").is_file()
    # NOTE: the recipe's model.sliding_window (the family's own key) overrides the HF config's, into the export
    assert json.loads((run / "hf" / "config.json").read_text())["sliding_window"] == 64
    assert _run([py, "-c", CHECK, str(hf_in), str(run / "hf")]).strip().endswith("ok")


# run in the venv: validate --show of the family's recipe, then the recipes that must be refused, in one process
OWN_KEY = """
import contextlib, io, json, sys
import loongforge_phi3
from loongforge.cli import main
recipe, llama = str(loongforge_phi3.RECIPE), sys.argv[1]
out = {}
for name, args in (("show", [recipe, "--show"]), ("zero", [recipe, "model.sliding_window=0"]),
                   ("longer", [recipe, "data.seq_length=128"]), ("llama", [llama, "model.sliding_window=64"])):
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        rc = main(["validate", *args])
    out[name] = [rc, o.getvalue(), e.getvalue()]
print(json.dumps(out))
"""


def test_a_family_declares_its_own_recipe_key(venv):
    """``model.sliding_window`` is a key of the phi3 family's own ``model`` section: its recipe validates and shows
    it, a wrong value is refused naming the key's path, and another family's recipe refuses the key naming phi3."""
    py = str(venv / "bin" / "python")
    llama = EXAMPLE.parents[1] / "recipes" / "llm" / "tiny" / "llama_tiny.yaml"
    got = json.loads(_run([py, "-c", OWN_KEY, str(llama)]).strip().splitlines()[-1])
    rc, shown, _ = got.pop("show")
    assert rc == 0 and yaml.safe_load(shown)["model"]["sliding_window"] == 64
    assert yaml.safe_load(shown)["model"]["family"] == "phi3"
    for name, key, words in (("zero", "model.sliding_window", "greater than or equal to 1"),
                             ("longer", "data.seq_length", "sliding_window 64"),
                             ("llama", "model.sliding_window", "phi3 model family")):
        rc, _, err = got[name]
        assert rc == 2 and err.count("\n") == 1 and f"key '{key}'" in err and words in err, (name, err)

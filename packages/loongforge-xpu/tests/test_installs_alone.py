"""The Kunlun plugin installed alone with core (README, "Install only what you need"), into a fresh venv:
``loongforge plugins`` shows the accelerator (why it is unavailable without the runtime; available with the
simulated one), and a kunlun recipe whose backend is not installed is refused with the one line naming it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from fresh_venv import REPO, fresh_venv, run

SIM_DIR = Path(__file__).parent / "simulated_runtime"
# run in the venv: `loongforge plugins`, then `loongforge validate RECIPE`: [exit code, stdout, stderr] of each
BOTH = """
import contextlib, io, json, sys
from loongforge.cli import main
out = []
for args in (["plugins"], ["validate", sys.argv[1]]):
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        rc = main(args)
    out.append([rc, o.getvalue(), e.getvalue()])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_xpu_installs_alone_and_lists_kunlun(tmp_path):
    venv = fresh_venv(tmp_path)
    inst = venv.install(REPO / "packages" / "loongforge-core", REPO / "packages" / "loongforge-xpu")
    assert inst.returncode == 0, inst.stderr[-2000:]
    assert not venv.installed() & {"megatron-core", "lerobot", "diffusers"}

    # one interpreter without the runtime: plugins, then a kunlun recipe whose backend is missing
    recipe = tmp_path / "kunlun.yaml"
    recipe.write_text(yaml.safe_dump({"backend": "megatron", "model": {"preset": "llama-tiny"},
                                      "accelerator": {"name": "kunlun"}}))
    got = run([venv.python, "-c", BOTH, recipe])
    assert got.returncode == 0, got.stderr[-3000:]
    (rc, listing, _), (code, _, err) = json.loads(got.stdout.splitlines()[-1])
    line = next(ln for ln in listing.splitlines() if ln.strip().startswith("kunlun"))
    assert rc == 0 and "loongforge-xpu" in line and "'torch_xmlir' is not installed" in line, line
    assert code == 2 and err.count("\n") == 1, err
    assert "uv pip install ./packages/loongforge-megatron" in err and "Traceback" not in err

    # the simulated runtime (its folder's sitecustomize) makes it available
    listing = run([venv.cli, "plugins"], env={**os.environ, "PYTHONPATH": str(SIM_DIR)})
    assert listing.returncode == 0, listing.stderr[-2000:]
    line = next(ln for ln in listing.stdout.splitlines() if ln.strip().startswith("kunlun"))
    assert line.endswith("[available]"), line

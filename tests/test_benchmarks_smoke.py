"""Every benchmark script's CPU smoke mode (``--smoke``: tiny shapes, 2 steps, variants in this process), so none
rots: each run must produce its report, a row per variant in its results table, and agreeing losses where ours and
the peer train the same model on the same data."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def load():
    """Import a benchmark script as a module; ``harness`` (which they import by name) first."""
    saved = sys.modules.get("harness")

    def _load(name: str, *, as_name: str | None = None):
        as_name = as_name or f"benchmarks_{name}"
        spec = importlib.util.spec_from_file_location(as_name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[as_name] = module  # NOTE: dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
        return module

    _load("harness", as_name="harness")
    yield _load
    if saved is None:
        sys.modules.pop("harness", None)
    else:
        sys.modules["harness"] = saved


def _table_rows(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith("| 20")]


@pytest.mark.parametrize(("script", "ours", "peer", "tol"), [
    ("llm_throughput", "loongforge", "hf_eager", 1e-4),
    ("moe_throughput", "loongforge", "hf_grouped_mm", 1e-3),
    ("dit_throughput", "loongforge", "diffusers_eager", 1e-3),
    ("wan_throughput", "loongforge", "diffusers_eager", 1e-4),
    ("qwen_image_throughput", "loongforge", "diffusers_eager", 1e-4),
    ("dsa_throughput", "loongforge_sparse", "loongforge_dense", None),  # NOTE: sparse vs dense attention
    ("vlm_throughput", "loongforge", "hf_eager", 1e-2),
    ("fp8_throughput", "ours_bf16", "hf_eager_bf16", None),  # NOTE: the HF peer draws its own init and tokens
])
def test_training_benchmark_smoke(load, tmp_path, script, ours, peer, tol):
    harness = sys.modules["harness"]
    rows = load(script).main(["--smoke", "--results", str(tmp_path), "--out", str(tmp_path / "report.md")])
    assert set(rows) == {ours, peer}
    for r in rows.values():
        assert "error" not in r, r
        assert len(r["losses"]) == 2 and r["rate"] > 0
    if tol is not None:
        assert harness.loss_diff(rows[ours]["losses"], rows[peer]["losses"]) < tol
    report = (tmp_path / "report.md").read_text()
    assert report.rstrip().splitlines()[-1].startswith(f"{ours} / {peer}: ")  # the ratio prints last
    table = _table_rows(tmp_path / f"{script}.md")
    assert [line.split(" | ")[3] for line in table] == [ours, peer]  # date | hardware | setup | variant
    assert "CPU" in table[0].split(" | ")[1]


def test_kernels_benchmark_smoke(tmp_path):
    """The kernel benchmark re-runs itself under Triton's interpreter on CPU, so it runs as a process here."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(BENCH / "kernels_bench.py"), "--smoke", "--results", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=BENCH)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split(" | ") for line in _table_rows(tmp_path / "kernels_bench.md")]
    assert {(r[2], r[4]) for r in rows} == {("rope", "loongforge"), ("rope", "eager")}
    assert not any("failed" in r[5] for r in rows)
    assert "| rope |" in out.stdout.rsplit("## Ratios", 1)[1]  # the ratios print last


def test_vla_benchmark_smoke(load, tmp_path):
    res = load("vla_throughput").main(["--smoke", "--results", str(tmp_path)])
    assert res["ours"]["samples_per_s"] > 0 and res["ours"]["policy"] == "tiny_vla"
    rows = [line.split(" | ") for line in _table_rows(tmp_path / "vla_throughput.md")]
    assert [r[3] for r in rows] == ["ours"] and "CPU" in rows[0][1]


def test_smolvla_benchmark_smoke(load, tmp_path):
    """Both sides train the same trainable parameters (LeRobot's train_expert_only = our model.freeze)."""
    rows = load("smolvla_throughput").main(["--smoke", "--results", str(tmp_path), "--out", str(tmp_path / "r.md")])
    assert set(rows) == {"loongforge", "lerobot_step"}
    for r in rows.values():
        assert "error" not in r, r
        assert len(r["losses"]) == 2 and r["rate"] > 0
    assert rows["loongforge"]["trainable_m"] == rows["lerobot_step"]["trainable_m"] > 0
    assert rows["loongforge"]["init_sum"] == pytest.approx(rows["lerobot_step"]["init_sum"], rel=1e-9)  # same init
    assert (tmp_path / "r.md").read_text().rstrip().splitlines()[-1].startswith("loongforge / lerobot_step: ")
    assert len(_table_rows(tmp_path / "smolvla_throughput.md")) == 2


@pytest.mark.parametrize("policy", ["lerobot_groot", "lerobot_fastwam"])
def test_policy_benchmark_smoke(load, tmp_path, policy):
    """GR00T N1.7 / FastWAM: both sides train the same parameters (LeRobot's tune_* / freeze_video_expert = our
    model.freeze) from the same random init; the ratio prints last; one row per side in the table."""
    rows = load("policy_throughput").main(["--policy", policy, "--smoke", "--results", str(tmp_path),
                                           "--out", str(tmp_path / "r.md")])
    assert set(rows) == {"loongforge", "lerobot_step"}
    for r in rows.values():
        assert "error" not in r, r
        assert len(r["losses"]) == 2 and r["rate"] > 0
    ours, peer = rows["loongforge"], rows["lerobot_step"]
    assert ours["trainable_m"] == peer["trainable_m"] > 0
    assert ours["init_sum"] == pytest.approx(peer["init_sum"], rel=1e-9)
    assert (tmp_path / "r.md").read_text().rstrip().splitlines()[-1].startswith("loongforge / lerobot_step: ")
    table = _table_rows(tmp_path / "policy_throughput.md")
    assert [line.split(" | ")[3] for line in table] == ["loongforge", "lerobot_step"]
    assert table[0].split(" | ")[2].startswith(policy)


def test_checkpoint_convert_memory_smoke(load, tmp_path):
    rows = load("checkpoint_convert_memory").main(["--smoke", "--results", str(tmp_path)])
    assert [r["direction"] for r in rows] == ["hf_to_megatron", "megatron_to_hf"]
    table = [line.split(" | ") for line in _table_rows(tmp_path / "checkpoint_convert_memory.md")]
    assert [r[3] for r in table] == ["hf_to_megatron", "megatron_to_hf"]


def test_fp8_allgather_codec_smoke(load, tmp_path):
    c = load("fp8_allgather").main(["--smoke", "--results", str(tmp_path)])
    assert c["bit_identical"] is True  # the backend's codec equals the kernels package's reference, byte for byte
    table = [line.split(" | ") for line in _table_rows(tmp_path / "fp8_allgather.md")]
    assert [r[3] for r in table] == ["encode", "decode"]


def test_scaling_benchmark_smoke(load, tmp_path):
    """Two gloo processes each side: ours through ``loongforge train --nproc 2``, the peer HF + DDP under torchrun;
    the same global batches, so the global losses agree."""
    harness = sys.modules["harness"]
    rows = load("scaling").main(["--smoke", "--results", str(tmp_path), "--out", str(tmp_path / "report.md")])
    assert set(rows) == {"loongforge_dp2", "torch_ddp_dp2"}
    for r in rows.values():
        assert "error" not in r, r
        assert len(r["losses"]) == 2 and r["rate"] > 0 and r["procs"] == 2
    assert harness.loss_diff(rows["loongforge_dp2"]["losses"], rows["torch_ddp_dp2"]["losses"]) < 1e-4
    report = (tmp_path / "report.md").read_text()
    assert report.rstrip().splitlines()[-1].startswith("loongforge_dp2 / torch_ddp_dp2: ")
    table = _table_rows(tmp_path / "scaling.md")
    assert [line.split(" | ")[3] for line in table] == ["loongforge_dp2", "torch_ddp_dp2"]


def test_hetero_vlm_benchmark_smoke(load, tmp_path):
    """Two measured CPU layouts of the tiny Qwen2.5-VL (one process; pp 2 with the decoupled encoder: the same
    losses) and every modelled 8-GPU layout; the table marks which rows are measured and which modelled."""
    harness = sys.modules["harness"]
    bench = load("hetero_vlm")
    rows = bench.main(["--smoke", "--results", str(tmp_path), "--out", str(tmp_path / "report.md")])
    assert set(rows) == {"cpu_one", "cpu_pp2_decoupled", *bench.MODELLED}
    for r in rows.values():
        assert "error" not in r, r
        assert r["rate"] > 0 and r["step_s"] > 0
    assert harness.loss_diff(rows["cpu_pp2_decoupled"]["losses"], rows["cpu_one"]["losses"]) < 1e-5
    assert rows["cpu_pp2_decoupled"]["vit_s"] > 0  # NOTE: the first stage's encoder_time_r0
    # NOTE: the lognormal batch is uneven over 4 DP ranks; the balancer evens it (the same samples)
    assert rows["model_tp2_vtp1_dp4"]["dp_imbalance"] > 1.2 > 1.05 > rows["model_tp2_vtp1_dp4_balanced"]["dp_imbalance"]
    table = [line.split(" | ") for line in _table_rows(tmp_path / "hetero_vlm.md")]
    kinds = {r[3]: r[8] for r in table}  # date | hardware | setup | variant | samples/s | MFU | peak | loss | kind
    assert kinds["cpu_one"].startswith("measured") and kinds["model_tp2_dp4"].startswith("modelled"), kinds
    report = (tmp_path / "report.md").read_text()
    assert report.rstrip().splitlines()[-1].startswith("model_disjoint_v2_lm6 / model_tp2_dp4: ")

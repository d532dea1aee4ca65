"""Failure contracts of the core: recipe floats are finite, recipe loading is bounded, metrics.jsonl is strict
JSON, a BaseException (DCP's CheckpointException) is one line, the launcher reports the signal of the rank that
died first, and single-node stores listen on loopback only."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from loongforge.errors import RecipeError

RECIPE = """backend: embodied
data: {format: synthetic}
"""


def _recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("value", ["inf", "-inf", ".inf", ".nan", "nan", "1e400", "-1e400"])
@pytest.mark.parametrize("key", ["train.lr", "train.grad_clip", "train.weight_decay", "train.adam_eps",
                                 "train.ema_decay", "train.min_lr"])
def test_nonfinite_recipe_floats_are_refused_naming_the_key(tmp_path, key, value):
    from loongforge.recipe import load_recipe

    with pytest.raises(RecipeError, match=rf"key '{key}': Input should be a finite number"):
        load_recipe(_recipe(tmp_path, RECIPE), [f"{key}={value}"], backend_schemas=False)


def test_skip_nonfinite_is_a_train_key():
    from loongforge.recipe.schema import TrainConfig

    assert TrainConfig().skip_nonfinite is False and TrainConfig(skip_nonfinite=True).skip_nonfinite is True


def test_alias_bomb_is_refused_before_it_expands(tmp_path):
    from loongforge.recipe import load_recipe

    lines = ["    a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcdefg", "bcdefgh", strict=True):
        lines.append(f"    {name}: &{name} [{', '.join([f'*{prev}'] * 10)}]")
    text = RECIPE + "accelerator:\n  options:\n" + "\n".join(lines) + "\n"
    with pytest.raises(RecipeError, match="expands to more than 1,000,000 values") as err:
        load_recipe(_recipe(tmp_path, text), backend_schemas=False)
    assert "accelerator.options" in str(err.value)


@pytest.mark.parametrize("form", ["flow", "block"])
def test_deep_nesting_is_a_clear_error_not_a_recursion_error(tmp_path, form):
    from loongforge.recipe import load_recipe

    if form == "flow":
        text = RECIPE + "accelerator:\n  options:\n    x: " + "[" * 5000 + "]" * 5000 + "\n"
    else:
        text = RECIPE + "accelerator:\n  options:\n" + "".join(" " * (4 + i) + "k:\n" for i in range(200)) + " " * 210 + "1\n"
    with pytest.raises(RecipeError, match=r"r\.yaml: recipe nests deeper than 64 levels at line \d+"):
        load_recipe(_recipe(tmp_path, text), backend_schemas=False)


def test_deep_override_is_a_clear_error(tmp_path):
    from loongforge.recipe import load_recipe

    with pytest.raises(RecipeError, match="override 'accelerator.options.x' nests deeper than 64"):
        load_recipe(_recipe(tmp_path, RECIPE), ["accelerator.options.x=" + "[" * 5000 + "]" * 5000],
                    backend_schemas=False)
    with pytest.raises(RecipeError, match="nests deeper than 64 levels"):
        load_recipe(_recipe(tmp_path, RECIPE), ["accelerator.options." + ".".join(["k"] * 5000) + "=1"],
                    backend_schemas=False)


def test_oversized_recipe_is_refused(tmp_path):
    from loongforge.recipe import load_recipe

    path = _recipe(tmp_path, RECIPE + "description: '" + "x" * (9 * 2**20) + "'\n")
    with pytest.raises(RecipeError, match="larger than a recipe can be"):
        load_recipe(path, backend_schemas=False)


def test_metrics_jsonl_is_strict_json_with_null_for_nonfinite(tmp_path):
    from loongforge.metrics import MetricsLogger, read_metrics

    log = MetricsLogger(tmp_path, config=SimpleNamespace(interval=1, console=True, tensorboard=False, jsonl=True))
    log.log(1, {"loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
    log.close()

    def refuse(name):
        raise ValueError(name)

    rec = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=refuse)
    assert rec == {"step": 1, "loss": None, "grad_norm": None, "lr": 1e-3}
    assert read_metrics(tmp_path)[0]["loss"] is None


def test_base_exception_subclass_is_one_line(monkeypatch, capsys):
    from loongforge import cli

    class DcpLike(BaseException):
        pass

    def boom(args):
        raise DcpLike("CheckpointException ranks:dict_keys([0])\nTraceback: ...")

    monkeypatch.setitem(cli.COMMANDS, "recipes", boom)
    assert cli.main(["recipes"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["internal error: DcpLike: CheckpointException ranks:dict_keys([0]) (set LOONGFORGE_DEBUG=1 for the "
                   "traceback)"]


def _failure(code: int, pid: int):
    return SimpleNamespace(exitcode=code, pid=pid, timestamp=0)


@pytest.mark.parametrize(("failures", "code"), [
    ({1: _failure(-9, 11), 0: _failure(-15, 10)}, 137),  # OOM kill of rank 1, rank 0 stopped by torchrun
    ({0: _failure(-11, 10), 1: _failure(-9, 11)}, 139),  # a segfault first, a SIGKILL after the grace period
    ({0: _failure(-15, 10), 1: _failure(-15, 11)}, 143),  # the job itself was stopped
    ({1: _failure(-15, 11), 0: _failure(2, 10)}, 2),  # a rank's own error
])
def test_launcher_reports_the_rank_that_died_first(failures, code, capsys):
    from loongforge.launcher import _failed_exit_code

    assert _failed_exit_code(failures) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == (0 if code == 2 else 1)


def _listening_ports() -> dict[int, str]:
    out = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]): line.split()[3].rsplit(":", 1)[0] for line in out.splitlines()}


@pytest.mark.skipif(subprocess.run(["which", "ss"], capture_output=True).returncode != 0, reason="needs ss")
def test_single_process_store_listens_on_loopback_only():
    from loongforge.runtime import loopback_store

    store = loopback_store()
    store.set("k", "v")
    assert store.get("k") == b"v"
    assert _listening_ports()[store.port] == "127.0.0.1"
    with pytest.raises(OSError):  # NOTE: not reachable through another address of this machine
        ip = next((a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
                   if not a[4][0].startswith("127.")), None)
        if ip is None:
            raise OSError("no external address")
        socket.create_connection((ip, store.port), timeout=2).close()


def test_single_node_launch_uses_the_loopback_rendezvous(tmp_path):
    from loongforge.launcher import LaunchConfig, torchrun_command

    cmd = torchrun_command(LaunchConfig(nproc=2), recipe_file=tmp_path / "r.yaml", output_dir=tmp_path)
    assert "--rdzv-backend=loongforge-loopback" in cmd and "--local-addr=127.0.0.1" in cmd
    assert "--standalone" not in cmd
    multi = torchrun_command(LaunchConfig(nproc=2, nnodes="2", rdzv_endpoint="head:29400"), recipe_file=tmp_path,
                             output_dir=tmp_path)
    assert "--rdzv-backend=c10d" in multi and "--rdzv-endpoint=head:29400" in multi


def _agree_rank(*, rank: int, world: int) -> str:
    import torch.distributed as dist
    from loongforge.errors import PeerFailedError
    from loongforge.failures import agree

    dist.init_process_group("gloo")
    try:
        agree(None, phase="build")  # NOTE: all fine: returns on every rank
        mine = ValueError("bad rank file") if rank == 1 else None
        try:
            agree(mine, phase="resume")
            return "returned"
        except PeerFailedError as exc:
            return f"peer {exc.rank}: {exc}"
        except ValueError as exc:
            return f"own: {exc}"
    finally:
        dist.destroy_process_group()


def test_agree_ends_the_phase_on_every_rank_with_the_failing_ranks_error(ranks, tmp_path):
    rank0, rank1 = ranks(_agree_rank, world=2, out=tmp_path, timeout_s=120)  # NOTE: the watchdog: agree() hung
    assert rank1 == "own: bad rank file"
    assert rank0.startswith("peer 1: rank 1 failed during resume (1 of 2 ranks)")


def _check(*, rank: int, world: int, failing: list[int], internal: bool) -> tuple[str, str] | None:
    import torch.distributed as dist
    from loongforge.errors import CheckpointError
    from loongforge.failures import agree

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        error = None
        if rank in failing:
            error = RuntimeError("boom") if internal else CheckpointError(f"/ckpt/rank_{rank:05d}.pt is unreadable")
        try:
            agree(error, phase="resume")
        except Exception as exc:  # noqa: BLE001 - the test looks at what each rank raised
            return type(exc).__name__, str(exc)
        return None
    finally:
        dist.destroy_process_group()


def test_one_failing_rank_fails_every_rank_with_its_message(ranks, tmp_path):
    """A user error on one rank reaches every rank in the same collective, as one message (printed once)."""
    out = ranks(_check, world=2, out=tmp_path, timeout_s=120, failing=[1], internal=False)
    assert out == [("PeerFailedError", "/ckpt/rank_00001.pt is unreadable"),
                   ("CheckpointError", "/ckpt/rank_00001.pt is unreadable")]


def test_all_ok_passes_and_internal_errors_keep_their_type(ranks, tmp_path):
    assert ranks(_check, world=2, out=tmp_path / "ok", timeout_s=120, failing=[], internal=False) == [None, None]
    out = ranks(_check, world=2, out=tmp_path / "bug", timeout_s=120, failing=[0], internal=True)
    assert out == [("RuntimeError", "boom"),
                   ("PeerFailedError", "rank 0 failed during resume (1 of 2 ranks): RuntimeError: boom")]


def test_several_failing_ranks_report_the_first(ranks, tmp_path):
    out = ranks(_check, world=2, out=tmp_path, timeout_s=120, failing=[0, 1], internal=False)
    assert all(msg.startswith("/ckpt/rank_00000.pt is unreadable (and 1 other error on other ranks)") for _, msg in out), out


def test_readme_says_a_recipe_is_trusted_code():
    root = Path(__file__).resolve().parents[3]
    for readme in (root / "README.md", root / "packages" / "loongforge-core" / "README.md"):
        text = readme.read_text()
        assert "trusted code" in text and "kernel_overrides" in text and "LD_PRELOAD" in text, readme
    assert "listens" in (root / "README.md").read_text() and "127.0.0.1" in (root / "README.md").read_text()

"""Closed-loop evaluation: the policy server (OpenPI protocol, spoken to by the real openpi-client), the PushT
adapter, seeded episodes in spawned workers, and the reference policies whose scores check the harness itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "embodied" / "tiny_vla_pusht.yaml"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "loongforge", *args]


def _episodes(summary: dict) -> list[tuple]:
    return [(e["seed"], e["success"], e["length"], round(e["sum_reward"], 9)) for e in summary["per_episode"]]


def test_wilson_interval():
    from loongforge_embodied.eval.wilson import wilson_interval

    lo, hi = wilson_interval(0, 20)
    assert lo == 0.0 and hi == pytest.approx(0.1611, abs=1e-4)
    lo, hi = wilson_interval(20, 20)
    assert lo == pytest.approx(0.8389, abs=1e-4) and hi == 1.0
    lo, hi = wilson_interval(7, 10)
    assert (lo, hi) == (pytest.approx(0.3968, abs=1e-4), pytest.approx(0.8922, abs=1e-4))


def test_difference_interval():
    from loongforge_embodied.eval.wilson import difference_interval

    # Newcombe (1998), Statistics in Medicine 17:873, table II example (56/70 vs 48/80), method 10
    d, lo, hi = difference_interval(56, 70, 48, 80)
    assert (d, lo, hi) == (pytest.approx(0.2), pytest.approx(0.0524, abs=1e-4), pytest.approx(0.3339, abs=1e-4))
    d, lo, hi = difference_interval(0, 50, 0, 50)
    assert d == 0.0 and lo < 0.0 < hi and lo == pytest.approx(-hi)


@pytest.mark.slow
def test_reference_policies_through_server_and_openpi_client(tmp_path):
    """The scripted expert succeeds, random fails, and the same seeds give the same episodes again."""
    from loongforge_embodied.eval.envs.pusht import PushTAdapter
    from loongforge_embodied.eval.evaluate import evaluate
    from loongforge_embodied.eval.server import PolicyServer

    with PolicyServer(PushTAdapter.reference_policy("expert"), port=0) as server:
        expert = evaluate(address=server.address, env="pusht", episodes=20, workers=2, seed=0, out_dir=tmp_path / "e")
        again = evaluate(address=server.address, env="pusht", episodes=3, workers=1, seed=5)
    assert expert["errors"] == [] and expert["success_rate"] >= 0.9, expert["episode_lengths"]
    assert expert["success_ci95"][0] > 0.6 and expert["policy"] == "expert"
    assert _episodes(again) == _episodes(expert)[5:8]
    saved = json.loads((tmp_path / "e" / "summary.json").read_text())
    assert saved["success_rate"] == expert["success_rate"] and len(saved["episode_lengths"]) == 20
    assert (tmp_path / "e" / "plot.png").stat().st_size > 1000

    with PolicyServer(PushTAdapter.reference_policy("random"), port=0) as server:
        runs = [evaluate(address=server.address, env="pusht", episodes=20, workers=2, seed=0, max_steps=40,
                         out_dir=tmp_path / f"r{i}", videos=1 - i) for i in range(2)]
    assert runs[0]["success_rate"] <= 0.1 and runs[0]["episode_lengths"] == [40] * 20
    assert _episodes(runs[0]) == _episodes(runs[1])
    import av

    with av.open(str(tmp_path / "r0" / "videos" / "episode_0000.mp4")) as video:
        frames = [f for f in video.decode(video=0)]
    assert len(frames) == 41 and frames[0].width == 256  # the reset frame + one per step
    assert not (tmp_path / "r1" / "videos").exists()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """Two expert episodes recorded by ``loongforge data prepare``'s recorder (64x64 images, as the recipe), one
    per worker process (``data.record.workers``): the replay test then also checks that the merge keeps each seed's
    frames and actions in order."""
    from loongforge_embodied.data.record import record_pusht

    root = tmp_path_factory.mktemp("pusht") / "data"
    return record_pusht(root, repo_id="local/pusht", episodes=2, max_steps=300, image_size=64, seed=0, workers=2)


@pytest.mark.slow
def test_replaying_recorded_expert_actions_succeeds(recorded):
    """Open-loop replay of what was recorded, from the recorded seeds, through the same server path."""
    from loongforge_embodied.eval.envs.pusht import PushTAdapter
    from loongforge_embodied.eval.evaluate import evaluate
    from loongforge_embodied.eval.server import PolicyServer

    info = json.loads((recorded / "meta" / "info.json").read_text())
    with PolicyServer(PushTAdapter.reference_policy("replay", dataset=recorded), port=0) as server:
        s = evaluate(address=server.address, env="pusht", episodes=2, workers=1, seed=0)
    assert s["errors"] == [] and s["success_rate"] == 1.0
    # NOTE: the recording stops at success too: replay ends on the recorded episode's last frame
    assert sum(s["episode_lengths"]) == info["total_frames"]


def _tiny_vla_policy():
    import torch
    from loongforge_embodied.eval.envs.pusht import TASK
    from loongforge_embodied.eval.trained_policy import TrainedPolicy
    from loongforge_embodied.policies.tiny_vla.configuration_tiny_vla import PRESETS
    from loongforge_embodied.policies.tiny_vla.modeling_tiny_vla import TinyVLAModel

    torch.manual_seed(0)
    arch = PRESETS["tiny"].with_overrides(state_dim=2, action_dim=2, num_cameras=1)
    model = TinyVLAModel(arch)
    model.set_stats({"state_mean": torch.full((2,), 256.0), "state_std": torch.full((2,), 100.0),
                     "action_mean": torch.full((2,), 256.0), "action_std": torch.full((2,), 100.0)})
    return TrainedPolicy(model, policy="tiny_vla", cameras=["observation.image"], task=TASK), arch


def test_malformed_requests_get_an_error_and_the_server_keeps_serving():
    import websockets.sync.client
    from loongforge_embodied.eval.server import PolicyServer
    from openpi_client import msgpack_numpy
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    policy, arch = _tiny_vla_policy()
    size = arch.image_size
    good = {"observation.image": np.zeros((size, size, 3), np.uint8), "observation.state": np.array([100.0, 200.0]),
            "prompt": "Push the T-shaped block onto the target."}
    bad = {
        "missing 'observation.state'": {"observation.image": good["observation.image"]},
        "unexpected 'observation.images.top'": {**good, "observation.images.top": good["observation.image"]},
        f"'observation.image' has shape (32, 32, 3); expected uint8 ({size}, {size}, 3)":
            {**good, "observation.image": np.zeros((32, 32, 3), np.uint8)},
        "'observation.image' has dtype float32; expected uint8":
            {**good, "observation.image": np.zeros((size, size, 3), np.float32)},
        "'observation.state' has dtype int64": {**good, "observation.state": np.array([1, 2])},
        "'observation.state' has shape (3,)": {**good, "observation.state": np.zeros(3)},
        "'prompt' must be a string": {**good, "prompt": np.zeros(2)},
    }
    with PolicyServer(policy, port=0, batch_wait_s=0.05) as server:
        client = WebsocketClientPolicy(host=server.address)
        meta = client.get_server_metadata()
        assert meta["features"]["observation.image"] == {"shape": [size, size, 3], "dtype": "uint8"}
        for expected, request in bad.items():
            with pytest.raises(RuntimeError, match="error: ") as err:
                client.infer(request)
            assert expected in str(err.value), (expected, str(err.value))
        first = client.infer(good)["actions"]  # the same connection still serves
        assert first.shape == (arch.chunk_size, 2) and first.dtype == np.float32 and np.isfinite(first).all()
        with websockets.sync.client.connect(server.address, compression=None, max_size=None) as raw:
            raw.recv()
            raw.send(b"\xc1 not msgpack")
            assert raw.recv().startswith("error: not a msgpack request")
            raw.send("text")
            assert "binary msgpack" in raw.recv()
            raw.send(msgpack_numpy.packb(good))
            assert np.array_equal(msgpack_numpy.unpackb(raw.recv())["actions"], first)
        # Concurrent clients are batched; each chunk is its own request's, whatever it was batched with.
        states = [np.array([100.0 + 40 * i, 300.0 - 30 * i]) for i in range(4)]
        alone = [WebsocketClientPolicy(host=server.address).infer({**good, "observation.state": s})["actions"]
                 for s in states]
        together: list = [None] * 4

        def ask(i: int) -> None:
            together[i] = WebsocketClientPolicy(host=server.address).infer({**good, "observation.state": states[i]})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert server.stats["max_batch_seen"] > 1
        for i in range(4):
            np.testing.assert_allclose(together[i]["actions"], alone[i], rtol=1e-4, atol=1e-3)
        assert not np.allclose(alone[0], alone[1])  # the state reaches the policy


@pytest.mark.slow
def test_a_killed_worker_fails_its_episode_not_the_evaluation(tmp_path):
    from loongforge_embodied.eval.envs.pusht import PushTAdapter
    from loongforge_embodied.eval.evaluate import evaluate
    from loongforge_embodied.eval.server import PolicyServer

    def kill_second(episode: int, pid: int) -> None:
        if episode == 1:
            os.kill(pid, signal.SIGKILL)

    with PolicyServer(PushTAdapter.reference_policy("random"), port=0) as server:
        s = evaluate(address=server.address, env="pusht", episodes=4, workers=2, seed=0, max_steps=20,
                     on_episode_start=kill_second, out_dir=tmp_path)
    assert [e["episode"] for e in s["errors"]] == [1]
    assert "killed by SIGKILL during episode 1 (seed 1)" in s["errors"][0]["error"]
    assert s["episodes"] == 4 and s["episode_lengths"] == [20, 0, 20, 20] and s["success_rate"] == 0.0


@pytest.mark.slow
def test_cli_eval_serve_and_plugins(tmp_path, env):
    plugins = subprocess.run(_cli("plugins"), env=env, capture_output=True, text=True, timeout=120)
    assert plugins.returncode == 0, plugins.stderr
    block = plugins.stdout.split("loongforge.commands")[1]
    assert "serve" in block and "eval" in block and "loongforge-embodied" in block
    out = tmp_path / "out"
    run = subprocess.run(_cli("eval", str(RECIPE), "--policy", "random", "--episodes", "2", "--workers", "1",
                              "--max-steps", "5", "--videos", "0", "--output", str(out)),
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] == 2 and summary["seeds"] == [100_000, 100_001] and summary["policy"] == "random"
    assert "success 0/2" in run.stdout
    bad = subprocess.run(_cli("eval", str(tmp_path / "nope")), env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and len(bad.stderr.strip().splitlines()) == 1
    bad = subprocess.run(_cli("eval", str(RECIPE), "--policy", "random", "--env", "nosuch"), env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown --env 'nosuch'; registered: aloha, aloha_insertion, metaworld, pusht" in bad.stderr


def test_eval_interval_needs_a_simulator():
    from loongforge.errors import RecipeError
    from loongforge.recipe import load_recipe

    synthetic = ROOT / "recipes" / "embodied" / "tiny_vla_synthetic.yaml"
    with pytest.raises(RecipeError, match="data.eval_env") as err:
        load_recipe(synthetic, ["train.eval_interval=2"])
    assert err.value.key == "train.eval_interval"
    with pytest.raises(RecipeError, match="unknown environment 'nosuch'; registered: aloha, aloha_insertion, metaworld, pusht"):
        load_recipe(synthetic, ["train.eval_interval=2", "data.eval_env=nosuch"])
    assert load_recipe(synthetic, ["train.eval_interval=2", "data.eval_env=pusht"]).train.eval_interval == 2


@pytest.mark.slow
def test_eval_interval_logs_success_rate_during_training(recorded, tmp_path, env):
    run = tmp_path / "run"
    proc = subprocess.run(_cli("train", str(RECIPE), "--output", str(run), f"data.root={recorded}",
                               "train.steps=4", "train.warmup_steps=1", "train.eval_interval=2", "train.eval_steps=2",
                               "data.eval_max_steps=16", "checkpoint.save_format=[hf]", "logging.interval=2"),
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from loongforge.metrics import read_metrics

    evals = {r["step"]: r for r in read_metrics(run) if "eval/success_rate" in r}
    assert sorted(evals) == [2, 4]
    for r in evals.values():
        assert 0.0 <= r["eval/success_rate"] <= 1.0 and r["eval/mean_length"] > 0 and r["eval/errors"] == 0
        assert "loss" in r
    summary = json.loads((run / "eval" / "step_000004" / "summary.json").read_text())
    assert summary["seeds"] == [100_000, 100_001] and summary["episodes"] == 2
    assert not (run / "eval" / "step_000004" / "policy").exists()
    events = b"".join(p.read_bytes() for p in (run / "tensorboard").iterdir())
    assert b"eval/success_rate" in events


@pytest.mark.slow
def test_in_memory_source_is_lerobots_items_and_state_key_reads_the_privileged_pose(recorded):
    """data.in_memory gives LeRobot's items bit for bit (images, the padded action window, the task) for either
    state key; observation.environment_state is the expert's pose with gym-pusht's wrapped angle."""
    import torch
    from loongforge_embodied.data.dataset import InMemorySource, LeRobotSource
    from loongforge_embodied.policies.tiny_vla.configuration_tiny_vla import TinyVLAArch

    arch = TinyVLAArch(chunk_size=16)
    for key, dim in (("observation.state", 2), ("observation.environment_state", 5)):
        src = LeRobotSource(root=str(recorded), repo_id="local/pusht", arch=arch, cameras=None, state_key=key)
        mem = InMemorySource(src)
        assert len(mem) == len(src) and mem.stats()["state_mean"].shape == (dim,)
        n = len(src)
        for i in sorted({0, 1, n // 2, n - 16, n - 2, n - 1, *range(0, n, 53)}):
            a, b = src[i], mem[i]
            assert a.keys() == b.keys() and a["task"] == b["task"]
            for k in ("images", "state", "actions", "action_pad"):
                assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (key, i, k)
        assert mem[n - 1]["action_pad"][1:].all() and not mem[0]["action_pad"].any()
    import pyarrow.parquet as pq

    # the two workers' shards, merged: one index 0..n-1, episode 0 (seed 0) first, each episode's frames in order
    table = pq.read_table(sorted(recorded.glob("data/*/*.parquet")), columns=["index", "episode_index", "frame_index"])
    table = table.sort_by("index")
    assert table.column("index").to_pylist() == list(range(n))
    ep, fr = table.column("episode_index").to_pylist(), table.column("frame_index").to_pylist()
    assert ep == sorted(ep) and set(ep) == {0, 1} and fr == [i - ep.index(e) for i, e in enumerate(ep)]
    pose = mem.state
    assert torch.equal(pose[:, :2], InMemorySource(LeRobotSource(root=str(recorded), repo_id="local/pusht", arch=arch,
                                                                  cameras=None)).state)
    assert ((pose[:, 4] >= 0) & (pose[:, 4] < 2 * np.pi)).all()
    from loongforge.errors import RecipeError
    from loongforge_embodied.config import DataConfig
    from loongforge_embodied.policies import dataset_shapes

    assert dataset_shapes(DataConfig(root=str(recorded), state_key="observation.environment_state"))["state_dim"] == 5
    with pytest.raises(RecipeError, match="'observation.pose' is not a vector feature of .*; allowed: "
                       "observation.state, observation.environment_state, "
                       "observation.environment_state_with_velocity") as err:
        dataset_shapes(DataConfig(root=str(recorded), state_key="observation.pose"))
    assert err.value.key == "data.state_key"


def test_a_policy_trained_on_another_state_key_is_served_under_it(tmp_path):
    """The export names the state feature the run read (data.state_key); the served policy asks for that key."""
    import torch
    from loongforge_embodied.eval.trained_policy import TrainedPolicy
    from loongforge_embodied.policies.tiny_vla import export
    from loongforge_embodied.policies.tiny_vla.configuration_tiny_vla import PRESETS
    from loongforge_embodied.policies.tiny_vla.modeling_tiny_vla import TinyVLAModel

    torch.manual_seed(0)
    arch = PRESETS["tiny"].with_overrides(state_dim=5, action_dim=2, num_cameras=1)
    model = TinyVLAModel(arch)
    export.write_pretrained(tmp_path / "hf", arch=arch, weights=model.state_dict(),
                            features={"cameras": ["observation.image"], "state": "observation.environment_state"})
    policy = TrainedPolicy.load(tmp_path / "hf")
    assert policy.state_key == "observation.environment_state"
    assert set(policy.spec) == {"observation.image", "observation.environment_state"}
    req = {"observation.image": np.zeros((64, 64, 3), np.uint8),
           "observation.environment_state": np.array([100, 200, 256, 256, 0.7], np.float32),
           "prompt": "Push the T-shaped block onto the target."}
    (out,) = policy.infer_batch([req])
    assert out["actions"].shape == (arch.chunk_size, 2) and np.isfinite(out["actions"]).all()


def test_a_linear_state_input_resolves_what_state_bins_cannot_and_is_served(tmp_path):
    """model.arch.state_input "linear" (pi0's continuous state token): two poses in one state bin give one prefix
    with bins and two with the projection; its export is served like the binned one (same mask length)."""
    import torch
    from loongforge_embodied.eval.trained_policy import TrainedPolicy
    from loongforge_embodied.policies.tiny_vla import export
    from loongforge_embodied.policies.tiny_vla.configuration_tiny_vla import PRESETS
    from loongforge_embodied.policies.tiny_vla.modeling_tiny_vla import TinyVLAModel
    from loongforge_embodied.policies.tiny_vla.processor_tiny_vla import prepare_batch

    stats = {"state_mean": torch.zeros(5), "state_std": torch.full((5,), 100.0)}
    raw = {"state": torch.tensor([[250.0, 250, 256, 256, 0.7], [250.1, 250, 256, 256, 0.7]]),
           "images": torch.zeros(2, 1, 3, 64, 64), "task": ["push"] * 2}
    prefixes = {}
    for mode in ("tokens", "linear"):
        torch.manual_seed(0)
        arch = PRESETS["tiny"].with_overrides(state_dim=5, state_input=mode)
        model = TinyVLAModel(arch).eval()
        batch = prepare_batch(raw, arch=arch, stats=stats)
        assert batch["lang_mask"].shape[1] == arch.max_text_tokens + (1 if mode == "linear" else 5)
        with torch.no_grad():
            prefixes[mode] = model.embed_prefix(batch)
        assert prefixes[mode].shape[1] == arch.image_tokens + batch["lang_mask"].shape[1]
    assert torch.equal(prefixes["tokens"][0], prefixes["tokens"][1])
    assert not torch.allclose(prefixes["linear"][0], prefixes["linear"][1])
    export.write_pretrained(tmp_path / "hf", arch=arch, weights=model.state_dict(),
                            features={"cameras": ["observation.image"], "state": "observation.environment_state"})
    policy = TrainedPolicy.load(tmp_path / "hf")
    req = {"observation.image": np.zeros((64, 64, 3), np.uint8),
           "observation.environment_state": np.array([100, 200, 256, 256, 0.7], np.float32), "prompt": "push"}
    (out,) = policy.infer_batch([req])
    assert out["actions"].shape == (arch.chunk_size, 2) and np.isfinite(out["actions"]).all()
    with pytest.raises(ValueError, match="'state_input' must be one of"):
        TinyVLAModel(PRESETS["tiny"].with_overrides(state_input="fourier"))


@pytest.mark.slow
def test_aloha_conventions_seeded_episodes_and_random_reference(tmp_path):
    """gym-aloha through our adapter: LeRobot's aloha_sim keys, dtypes and shapes, the same seed gives the same
    start (another seed moves the cube), and the random policy scores 0 reproducibly through the server."""
    pytest.importorskip("gym_aloha", reason="needs the extra loongforge-embodied[aloha] (gym-aloha + MuJoCo; not in "
                        "the workspace's test environment)")
    from loongforge_embodied.eval.envs import load_env
    from loongforge_embodied.eval.evaluate import evaluate
    from loongforge_embodied.eval.server import PolicyServer

    cls = load_env("aloha")
    env = cls(image_size=48)
    try:
        first = env.reset(seed=3)
        assert set(first) == {"observation.images.top", "observation.state", "prompt"}
        img, state = first["observation.images.top"], first["observation.state"]
        assert img.dtype == np.uint8 and img.shape == (48, 48, 3) and img.std() > 0
        assert state.dtype == np.float32 and state.shape == (14,)
        step = env.step(np.zeros(14, np.float32))
        assert step.observation["observation.state"].shape == (14,) and not step.success and step.reward == 0.0
        frame = env.render()
        assert frame.dtype == np.uint8 and frame.shape == (192, 256, 3)
        box = lambda: env.env.unwrapped._env.physics.data.qpos[16:19].copy()  # noqa: E731 - the cube's position
        env.reset(seed=3)
        a = box()
        np.testing.assert_array_equal(env.reset(seed=3)["observation.state"], state)
        assert np.array_equal(box(), a) and (env.reset(seed=4), not np.array_equal(box(), a))[1]
    finally:
        env.close()
    with PolicyServer(cls.reference_policy("random"), port=0) as server:
        runs = [evaluate(address=server.address, env="aloha", episodes=2, workers=1, seed=0, max_steps=15)
                for _ in range(2)]
    assert runs[0]["errors"] == [] and runs[0]["success_rate"] == 0.0 and runs[0]["episode_lengths"] == [15, 15]
    assert _episodes(runs[0]) == _episodes(runs[1])


@pytest.mark.slow
def test_metaworld_conventions_seeded_episodes_and_reference_policies(tmp_path):
    """MetaWorld reach-v3 through our adapter: LeRobot's keys, dtypes and shapes, seeded starts, and through the
    server MetaWorld's scripted expert succeeds while the random policy fails, the same seeds giving the same
    episodes."""
    pytest.importorskip("metaworld", reason="needs the extra loongforge-embodied[metaworld] (MetaWorld + MuJoCo; not "
                        "in the workspace's test environment)")
    from loongforge_embodied.eval.envs import load_env
    from loongforge_embodied.eval.evaluate import evaluate
    from loongforge_embodied.eval.server import PolicyServer

    cls = load_env("metaworld")
    env = cls(image_size=32)
    try:
        first = env.reset(seed=3)
        assert set(first) == {"observation.image", "observation.state", "observation.environment_state", "prompt"}
        assert first["observation.image"].dtype == np.uint8 and first["observation.image"].shape == (32, 32, 3)
        assert first["observation.image"].std() > 0
        assert first["observation.state"].shape == (4,) and first["observation.environment_state"].shape == (39,)
        np.testing.assert_array_equal(first["observation.state"], first["observation.environment_state"][:4])
        step = env.step(np.zeros(4, np.float32))
        assert step.observation["observation.environment_state"].dtype == np.float32 and not step.success
        again = env.reset(seed=3)["observation.environment_state"]
        np.testing.assert_array_equal(again, first["observation.environment_state"])
        other = env.reset(seed=4)["observation.environment_state"]
        assert not np.array_equal(other[-3:], again[-3:])  # the goal moves with the seed
    finally:
        env.close()
    with PolicyServer(cls.reference_policy("expert"), port=0) as server:
        expert = [evaluate(address=server.address, env="metaworld", episodes=3, workers=1, seed=0, max_steps=150)
                  for _ in range(2)]
    assert expert[0]["errors"] == [] and expert[0]["success_rate"] == 1.0, expert[0]["episode_lengths"]
    assert _episodes(expert[0]) == _episodes(expert[1])
    with PolicyServer(cls.reference_policy("random"), port=0) as server:
        rnd = evaluate(address=server.address, env="metaworld", episodes=3, workers=1, seed=0, max_steps=40)
    assert rnd["errors"] == [] and rnd["success_rate"] == 0.0 and rnd["episode_lengths"] == [40] * 3


def test_an_evaluation_in_which_every_episode_errored_is_an_error_not_a_zero_score():
    from loongforge.errors import LoongForgeError
    from loongforge_embodied.eval.evaluate import refuse_unrun, summarize
    from loongforge_embodied.eval.rollout import EpisodeResult

    def summary(results):
        return summarize(results, env="pusht", policy="p", seed=0, max_steps=10, workers=1, wall_s=0.0)

    refuse_unrun(summary([EpisodeResult(0, 0, error="policy failed"), EpisodeResult(1, 1, success=True)]))
    with pytest.raises(LoongForgeError, match=r"every one of the 2 episodes failed .*seed 0: policy failed"):
        refuse_unrun(summary([EpisodeResult(0, 0, error="policy failed"), EpisodeResult(1, 1, error="x")]))

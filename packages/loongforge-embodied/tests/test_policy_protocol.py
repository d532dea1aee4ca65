"""Failure contracts of the policy protocol, both ways, with a fake peer: hostile frames to the server and from a
server to our client, one failing request batched with good ones, and the ``serve`` / ``eval`` arguments and
run-folder files. Every failure is one line; nothing crashes, hangs or sends a traceback."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import msgpack
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "embodied" / "tiny_vla_pusht.yaml"


class EchoPolicy:
    """A fake policy: each chunk is the request's state, doubled, four times; prompt "boom" makes it fail."""

    name, prompt = "echo", "required"

    def __init__(self):
        from loongforge_embodied.eval.protocol import image, vector

        self.spec = {"observation.image": image(4, 4), "observation.state": vector(2)}
        self.batches: list[int] = []

    def metadata(self):
        return {"policy": self.name, "features": {k: f.to_dict() for k, f in self.spec.items()}, "prompt": "required",
                "action_dim": 2, "chunk_size": 4, "n_action_steps": 4}

    def infer_batch(self, requests):
        self.batches.append(len(requests))
        if any(r["prompt"] == "boom" for r in requests):
            raise RuntimeError("boom in the policy\nsecond line of the failure")
        return [{"actions": np.tile(r["observation.state"] * 2, (4, 1)).astype(np.float32)} for r in requests]


def _good(state=(1.0, 2.0), prompt="push"):
    return {"observation.image": np.zeros((4, 4, 3), np.uint8), "observation.state": np.array(state, np.float32),
            "prompt": prompt}


def _nd(dtype, shape, data):
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}


OBJECT_ARRAY = _nd("|O", [2], b"\x41" * 16)  # two "pointers" taken from the sender's bytes


def _one_line_error(text) -> bool:
    return isinstance(text, str) and text.startswith("error: ") and "\n" not in text and "Traceback" not in text


# ---- the server: hostile requests from a fake client ----------------------------------------------------------


def _request_frames() -> dict[str, bytes]:
    """Generated hostile requests: every one must get a one-line error and leave the connection serving."""
    good = _good()
    img = {b"__ndarray__": True, b"data": bytes(48), b"dtype": "|u1", b"shape": [4, 4, 3]}

    def frame(**state) -> bytes:
        return msgpack.packb({"observation.image": img, "observation.state": _nd(**state), "prompt": "push"})

    frames: dict[str, bytes] = {}
    for dt in ("|O", "<U2", "|S8", "|V8", "<M8", "<m8", "<c8", "(2,)<f4", "bogus", "", "f" * 40, "<f4,<f4"):
        frames[f"state dtype {dt!r}"] = frame(dtype=dt, shape=[2], data=b"\x41" * 16)
    for shape in ([-1], [2**40], [1] * 20, "2", [1.5], [True, True], None, [[2]]):
        frames[f"state shape {shape!r}"[:60]] = frame(dtype="<f4", shape=shape, data=bytes(8))
    for data in (b"", bytes(7), bytes(9), "12345678", 8, None):
        frames[f"state data {data!r}"[:60]] = frame(dtype="<f4", shape=[2], data=data)
    frames["state as npgeneric object"] = msgpack.packb(
        {**{k: v for k, v in {"observation.image": img}.items()}, "prompt": "p",
         "observation.state": {b"__npgeneric__": True, b"data": 1, b"dtype": "|O"}})
    frames["npgeneric overflow"] = msgpack.packb({"observation.image": img, "prompt": "p",
                                                  "observation.state": {b"__npgeneric__": True, b"data": 2**63,
                                                                        b"dtype": "<i8"}})
    frames["npgeneric string data"] = msgpack.packb({"observation.image": img, "prompt": "p", "observation.state":
                                                     {b"__npgeneric__": True, b"data": "x", b"dtype": "<f4"}})
    frames["image as object array"] = msgpack.packb({"observation.image": _nd("|O", [4, 4, 3], bytes(384)),
                                                     "observation.state": _nd("<f4", [2], bytes(8)), "prompt": "p"})
    frames["prompt as object array"] = msgpack.packb({"observation.image": img, "prompt": OBJECT_ARRAY,
                                                      "observation.state": _nd("<f4", [2], bytes(8))})
    frames["extension type"] = msgpack.packb({"x": msgpack.ExtType(7, b"abc")})
    frames["timestamp"] = msgpack.packb({"observation.image": img, "observation.state": _nd("<f4", [2], bytes(8)),
                                         "prompt": msgpack.Timestamp(1, 0)}, datetime=False)
    frames["nested 100k deep"] = b"\x91" * 100_000 + b"\xc0"
    frames["a list"] = msgpack.packb([1, 2, 3])
    frames["a string"] = msgpack.packb("observation")
    frames["nil"] = msgpack.packb(None)
    frames["int keys"] = b"\x81\x01\x02"
    frames["truncated"] = msgpack.packb({"observation.state": list(range(100))})[:50]
    frames["trailing bytes"] = msgpack.packb({"a": 1}) + b"\x00"
    frames["invalid utf-8 key"] = b"\x81\xa2\xff\xfe\x01"
    frames["reserved byte"] = b"\xc1"
    frames["empty frame"] = b""
    rng = np.random.default_rng(0)
    for i in range(10):
        frames[f"random bytes {i}"] = rng.bytes(int(rng.integers(1, 300)))
    packed = msgpack.packb({"observation.image": img, "observation.state": _nd("<f4", [2], bytes(8)), "prompt": "push"})
    for cut in (1, 5, 17, 40, len(packed) - 1):
        frames[f"valid request cut at {cut}"] = packed[:cut]
    from openpi_client import msgpack_numpy

    for name, bad in {"missing state": {k: v for k, v in good.items() if k != "observation.state"},
                      "extra key": {**good, "observation.other": np.zeros(2)},
                      "NaN state": {**good, "observation.state": np.array([np.nan, 1], np.float32)},
                      "inf state": {**good, "observation.state": np.array([np.inf, 1], np.float32)},
                      "float image": {**good, "observation.image": np.zeros((4, 4, 3), np.float32)},
                      "int state": {**good, "observation.state": np.array([1, 2])},
                      "bool state": {**good, "observation.state": np.array([True, False])},
                      "state shape (3,)": {**good, "observation.state": np.zeros(3, np.float32)},
                      "empty prompt": {**good, "prompt": ""},
                      "blank prompt": {**good, "prompt": "   "},
                      "no prompt": {k: v for k, v in good.items() if k != "prompt"},
                      "prompt an int": {**good, "prompt": 3},
                      "prompt a list": {**good, "prompt": ["push"]},
                      "prompt 20k characters": {**good, "prompt": "p" * 20_000},
                      "state a list": {**good, "observation.state": [1.0, 2.0]},
                      "state a string": {**good, "observation.state": "1,2"},
                      "image empty": {**good, "observation.image": np.zeros((0, 4, 3), np.uint8)}}.items():
        frames[name] = msgpack_numpy.packb(bad)
    return frames


def test_hostile_requests_get_one_line_each_and_the_connection_keeps_serving():
    import websockets.sync.client
    from loongforge_embodied.eval.protocol import unpack
    from loongforge_embodied.eval.server import PolicyServer

    frames = _request_frames()
    assert len(frames) >= 70
    policy = EchoPolicy()
    failures = []
    with PolicyServer(policy, port=0, batch_wait_s=0.0) as server, \
            websockets.sync.client.connect(server.address, compression=None, max_size=None) as ws:
        ws.recv(timeout=10)
        from openpi_client import msgpack_numpy

        for name, frame in frames.items():
            ws.send(frame)
            reply = ws.recv(timeout=10)
            if not _one_line_error(reply):
                failures.append((name, str(reply)[:200]))
        ws.send("a text frame")
        assert _one_line_error(ws.recv(timeout=10))
        ws.send(msgpack_numpy.packb(_good((3.0, 4.0))))  # the same connection still serves
        actions = unpack(ws.recv(timeout=10), what="server reply")["actions"]
    assert failures == []
    np.testing.assert_array_equal(actions, np.tile([6.0, 8.0], (4, 1)))
    assert policy.batches == [1]  # no malformed request reached the policy


# ---- the client: hostile frames from a fake server, decoded in a child process ---------------------------------

_FAKE_SERVER = r'''
import json, sys, threading, time
import msgpack, numpy as np
from websockets.sync.server import serve
from loongforge_embodied.eval.client import PolicyClient
from loongforge_embodied.eval.protocol import ProtocolError, unpack

cases = [tuple(c) for c in json.loads(sys.stdin.read())]

def fix(value):
    # JSON cannot say bytes: {"$nd": [dtype, shape, hex]} is an __ndarray__
    if isinstance(value, dict) and "$nd" in value:
        dt, shape, data = value["$nd"]
        return {b"__ndarray__": True, b"dtype": dt, b"shape": fix(shape), b"data": bytes.fromhex(data)}
    if isinstance(value, dict):
        return {k: fix(v) for k, v in value.items()}
    if isinstance(value, list):
        return [fix(v) for v in value]
    return value

def handler(ws):
    i = int(ws.request.path.rsplit("/", 1)[1])
    meta, reply = cases[i][1], cases[i][2]
    for spec in (meta, reply):
        kind = spec[0]
        if kind == "none":
            time.sleep(3)
            return
        if kind == "close":
            return
        out = spec[1] if kind == "text" else msgpack.packb(fix(spec[1])) if kind == "msgpack" else bytes.fromhex(spec[1])
        if spec is reply:
            try:
                ws.recv(timeout=5)
            except Exception:
                return
        ws.send(out)
    try:
        ws.recv(timeout=5)
    except Exception:
        pass

server = serve(handler, "127.0.0.1", 0, compression=None, max_size=None)
threading.Thread(target=server.serve_forever, daemon=True).start()
port = server.socket.getsockname()[1]
req = {"observation.image": np.zeros((4, 4, 3), np.uint8), "observation.state": np.zeros(2, np.float32), "prompt": "p"}
out = []
for i, case in enumerate(cases):
    start = time.monotonic()
    try:
        client = PolicyClient(f"ws://127.0.0.1:{port}/case/{i}", timeout_s=1.0)
        actions = client.infer(req)["actions"]
        client.close()
        out.append(["ok", list(actions.shape), str(actions.dtype), time.monotonic() - start])
    except ProtocolError as exc:
        out.append(["error", str(exc), time.monotonic() - start])
    except BaseException as exc:
        import traceback
        out.append(["crash", traceback.format_exc(), time.monotonic() - start])
print(json.dumps(out))
'''


def _nd_json(dtype, shape, data: bytes) -> dict:
    return {"$nd": [dtype, shape, data.hex()]}


def _client_cases() -> list[tuple[str, list, list, bool]]:
    """(name, metadata frame, reply frame, the client must succeed)."""
    f32 = lambda *s: _nd_json("<f4", list(s), np.zeros(s, np.float32).tobytes())  # noqa: E731
    feats = {"observation.image": {"shape": [4, 4, 3], "dtype": "uint8"},
             "observation.state": {"shape": [2], "dtype": "float"}}
    meta = {"policy": "fake", "features": feats, "prompt": "optional", "action_dim": 2, "chunk_size": 3,
            "n_action_steps": 3}
    good_reply = ["msgpack", {"actions": f32(3, 2)}]
    cases: list[tuple[str, list, list, bool]] = [("a good server", ["msgpack", meta], good_reply, True)]
    obj = _nd_json("|O", [2], b"\x41" * 16)
    bad_meta = {
        "object array as features": {**meta, "features": obj},
        "object array in a feature": {**meta, "features": {**feats, "observation.state": obj}},
        "object array as a feature's shape": {**meta, "features": {**feats, "observation.state":
                                                                   {"shape": obj, "dtype": "float"}}},
        "object array as the prompt mode": {**meta, "prompt": obj},
        "object array as n_action_steps": {**meta, "n_action_steps": obj},
        "string array in features": {**meta, "features": _nd_json("<U1", [2], b"a\0\0\0b\0\0\0")},
        "features a list": {**meta, "features": [1, 2]},
        "features empty": {**meta, "features": {}},
        "no features": {k: v for k, v in meta.items() if k != "features"},
        "shape negative": {**meta, "features": {**feats, "observation.state": {"shape": [-2], "dtype": "float"}}},
        "shape huge": {**meta, "features": {**feats, "observation.state": {"shape": [2**40], "dtype": "float"}}},
        "shape a string": {**meta, "features": {**feats, "observation.state": {"shape": "2", "dtype": "float"}}},
        "shape empty": {**meta, "features": {**feats, "observation.state": {"shape": [], "dtype": "float"}}},
        "shape of floats": {**meta, "features": {**feats, "observation.state": {"shape": [2.0], "dtype": "float"}}},
        "shape of bools": {**meta, "features": {**feats, "observation.state": {"shape": [True], "dtype": "float"}}},
        "image not square": {**meta, "features": {**feats, "observation.image": {"shape": [4, 8, 3],
                                                                                  "dtype": "uint8"}}},
        "image 100000 wide": {**meta, "features": {**feats, "observation.image": {"shape": [100000, 100000, 3],
                                                                                   "dtype": "uint8"}}},
        "dtype unknown": {**meta, "features": {**feats, "observation.state": {"shape": [2], "dtype": "object"}}},
        "feature not a map": {**meta, "features": {**feats, "observation.state": [2]}},
        "prompt mode unknown": {**meta, "prompt": "sometimes"},
        "n_action_steps negative": {**meta, "n_action_steps": -1},
        "n_action_steps a float": {**meta, "n_action_steps": 1.5},
        "n_action_steps huge": {**meta, "n_action_steps": 10**12},
        "action_dim zero": {**meta, "action_dim": 0},
        "chunk_size a string": {**meta, "chunk_size": "3"},
        "policy a number": {**meta, "policy": 5},
        "metadata a list": [1, 2],
        "metadata nil": None,
    }
    for name, m in bad_meta.items():
        cases.append((name, ["msgpack", m], good_reply, False))
    for name, spec in {"metadata garbage": ["hex", "c1c1c1"], "metadata truncated": ["hex", "82a1"],
                       "metadata as text": ["text", "hello"], "metadata never sent": ["none"],
                       "closed before metadata": ["close"],
                       "metadata nested deep": ["hex", "91" * 5000 + "c0"],
                       "metadata extension": ["hex", "d40700"]}.items():
        cases.append((name, spec, good_reply, False))
    bad_replies = {
        "object array actions": {"actions": _nd_json("|O", [3, 2], b"\x41" * 48)},
        "object array shape": {"actions": {"$nd": ["<f4", obj, ""]}},
        "NaN actions": {"actions": _nd_json("<f4", [3, 2], np.full((3, 2), np.nan, np.float32).tobytes())},
        "inf actions": {"actions": _nd_json("<f8", [3, 2], np.full((3, 2), np.inf).tobytes())},
        "1-D actions": {"actions": f32(6)},
        "3-D actions": {"actions": f32(1, 3, 2)},
        "empty chunk": {"actions": f32(0, 2)},
        "wrong action_dim": {"actions": f32(3, 5)},
        "actions a list": {"actions": [[0.0, 0.0]]},
        "no actions": {"other": f32(3, 2)},
        "reply a list": [1],
        "data too short": {"actions": {"$nd": ["<f4", [3, 2], "00"]}},
        "shape overflow": {"actions": {"$nd": ["<f4", [2**62, 2**62], ""]}},
        "complex actions": {"actions": _nd_json("<c8", [3, 2], bytes(48))},
        "datetime actions": {"actions": _nd_json("<M8[s]", [3, 2], bytes(48))},
    }
    for name, r in bad_replies.items():
        cases.append((name, ["msgpack", meta], ["msgpack", r], False))
    for name, spec in {"reply garbage": ["hex", "c1"], "reply as a text error": ["text", "error: no\nTraceback ..."],
                       "reply never sent": ["none"], "closed before the reply": ["close"],
                       "reply nested deep": ["hex", "91" * 5000 + "c0"]}.items():
        cases.append((name, ["msgpack", meta], spec, False))
    cases.append(("int actions are numbers", ["msgpack", meta],
                  ["msgpack", {"actions": _nd_json("<i4", [3, 2], bytes(24))}], True))
    return cases


def test_hostile_server_frames_are_one_line_errors_in_the_client_never_a_crash_or_a_hang(env):
    """Object arrays in metadata features / a reply's actions / a feature's shape, NaN actions, silence and
    garbage from a fake server: our client (run in a child process: a crash would show as its exit) refuses
    each with one line, within the request timeout."""
    cases = _client_cases()
    assert len(cases) >= 50
    proc = subprocess.run([sys.executable, "-c", _FAKE_SERVER], input=json.dumps([c[:3] for c in cases]),
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    failures = []
    for (name, _, _, succeeds), res in zip(cases, results, strict=True):
        if res[-1] > 5:
            failures.append((name, f"took {res[-1]:.1f} s"))
        if succeeds and res[0] != "ok":
            failures.append((name, res))
        if not succeeds and not (res[0] == "error" and "\n" not in res[1] and "Traceback" not in res[1]):
            failures.append((name, res))
    assert failures == [], failures
    by_name = {c[0]: r for c, r in zip(cases, results, strict=True)}
    assert "'|O'" in by_name["object array in a feature"][1] and "server metadata" in by_name["object array in a feature"][1]
    assert "NaN or inf" in by_name["NaN actions"][1]
    assert "within 1 s" in by_name["reply never sent"][1]
    assert by_name["reply as a text error"][1] == "the policy server refused the request: error: no"
    assert by_name["a good server"][:3] == ["ok", [3, 2], "float32"]


def test_the_raw_openpi_decoder_builds_object_arrays_ours_refuses_them():
    """Why the client needs its own decoder: openpi-client's makes the object array (never touched here)."""
    from loongforge_embodied.eval.protocol import ProtocolError, unpack
    from openpi_client import msgpack_numpy

    frame = msgpack.packb({"actions": OBJECT_ARRAY})
    assert msgpack_numpy.unpackb(frame)["actions"].dtype == object
    with pytest.raises(ProtocolError, match=r"^server reply: an array has dtype '\|O'; allowed: bool, integer") as e:
        unpack(frame, what="server reply")
    assert "\n" not in str(e.value)
    ok = unpack(msgpack_numpy.packb({"a": np.arange(6, dtype=np.int16).reshape(2, 3), "b": np.float32(2.5)}),
                what="x")
    assert ok["a"].tolist() == [[0, 1, 2], [3, 4, 5]] and ok["b"] == np.float32(2.5)


# ---- per-request isolation in the batched server ---------------------------------------------------------------


def test_one_failing_request_in_a_batch_gets_its_error_and_the_others_their_actions():
    from loongforge_embodied.eval.client import PolicyClient
    from loongforge_embodied.eval.protocol import ProtocolError
    from loongforge_embodied.eval.server import PolicyServer

    policy = EchoPolicy()
    n = 8
    results: dict[int, object] = {}
    with PolicyServer(policy, port=0, max_batch=16, batch_wait_s=0.3) as server:
        clients = [PolicyClient(server.address, timeout_s=30) for _ in range(n + 1)]
        barrier = threading.Barrier(n + 1)

        def ask(i: int) -> None:
            barrier.wait()
            try:
                results[i] = clients[i].infer(_good((i, -i), prompt="boom" if i == n else "push"))["actions"]
            except ProtocolError as exc:
                results[i] = str(exc)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(n + 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        after = clients[n].infer(_good((5, 5)))["actions"]  # the failing client's connection still serves
        for c in clients:
            c.close()
    assert max(policy.batches) > 1, policy.batches  # the bad request was batched with good ones
    for i in range(n):
        np.testing.assert_array_equal(results[i], np.tile([2.0 * i, -2.0 * i], (4, 1)))
    assert results[n] == ("the policy server refused the request: error: the policy failed on this request "
                          "(RuntimeError: boom in the policy); the server's log has the traceback")
    np.testing.assert_array_equal(after, np.tile([10.0, 10.0], (4, 1)))


# ---- serve / eval arguments and run-folder files ---------------------------------------------------------------


def _cli(capsys, *args: str) -> tuple[int, list[str]]:
    from loongforge.cli import main

    try:
        rc = main(list(args))
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err.strip().splitlines()


def test_bad_serve_and_eval_arguments_are_one_line_exit_2(capsys):
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = str(busy.getsockname()[1])
    src = str(RECIPE)
    serve = ["serve", src, "--policy", "random"]
    ev = ["eval", src, "--policy", "random", "--videos", "0"]
    cases = {
        "port -1": ([*serve, "--port", "-1"], "--port -1"), "port 70000": ([*serve, "--port", "70000"], "0..65535"),
        "port abc": ([*serve, "--port", "abc"], "invalid int value"),
        "port in use": ([*serve, "--port", port], f"cannot serve on 127.0.0.1:{port}"),
        "host empty": ([*serve, "--host", ""], "--host"), "host with a space": ([*serve, "--host", "a b"], "--host"),
        "host not here": ([*serve, "--host", "192.0.2.1", "--port", "0"], "cannot serve on 192.0.2.1"),
        "max-batch 0": ([*serve, "--max-batch", "0"], "--max-batch 0"),
        "device nonsense": (["serve", str(ROOT), "--device", "nonsense"], "--device 'nonsense'"),
        "max-steps -5": ([*ev, "--max-steps", "-5"], "--max-steps must be an integer of at least 1"),
        "max-steps 0": ([*ev, "--max-steps", "0"], "--max-steps"), "replan 0": ([*ev, "--replan", "0"], "--replan"),
        "replan -1": ([*ev, "--replan", "-1"], "--replan"), "episodes 0": ([*ev, "--episodes", "0"], "--episodes"),
        "workers 0": ([*ev, "--workers", "0"], "--workers"), "workers 10**6": ([*ev, "--workers", "1000000"], "256"),
        "videos -1": ([*ev, "--videos", "-1"], "--videos"),
        "timeout 0": ([*ev, "--request-timeout", "0"], "--request-timeout"),
        "timeout nan": ([*ev, "--request-timeout", "nan"], "--request-timeout"),
        "timeout inf": ([*ev, "--request-timeout", "inf"], "--request-timeout"),
        "timeout -1": ([*ev, "--request-timeout", "-1"], "--request-timeout"),
        "server not ws": ([*ev, "--server", "http://127.0.0.1:1"], "ws://HOST:PORT"),
        "server not listening": ([*ev, "--server", f"ws://127.0.0.1:{port}", "--request-timeout", "1"],
                                 "127.0.0.1"),
        "eval max-batch 0": ([*ev, "--max-batch", "0"], "--max-batch 0"),
    }
    failures = []
    try:
        for name, (args, expected) in cases.items():
            rc, err = _cli(capsys, *args)
            if rc != 2 or len(err) != 1 or not err[0].startswith("error: ") or expected not in err[0]:
                failures.append((name, rc, err[-3:]))
    finally:
        busy.close()
    assert failures == [], failures


def test_serve_listens_on_localhost_unless_told():
    from loongforge.cli import build_parser

    args = build_parser("serve").parse_args(["serve", "RUN"])
    assert args.host == "127.0.0.1" and args.port == 8000
    assert "127.0.0.1" in (ROOT / "packages" / "loongforge-embodied" / "README.md").read_text().split(
        "loongforge serve runs/pusht")[1].splitlines()[0]


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """A tiny_vla export written directly (config.json + model.safetensors), without LeRobot."""
    import torch
    from loongforge_embodied.policies.lerobot_export import PREFIX
    from loongforge_embodied.policies.tiny_vla.configuration_tiny_vla import PRESETS
    from loongforge_embodied.policies.tiny_vla.modeling_tiny_vla import TinyVLAModel
    from safetensors.torch import save_file

    torch.manual_seed(0)
    arch = PRESETS["tiny"].with_overrides(state_dim=2, action_dim=2, num_cameras=1)
    out = tmp_path_factory.mktemp("export") / "hf"
    out.mkdir()
    cfg = {"type": "loongforge_tiny_vla", **arch.to_dict(), "camera_keys": ["observation.image"],
           "input_features": {"observation.image": {"type": "VISUAL", "shape": [3, 64, 64]},
                              "observation.state": {"type": "STATE", "shape": [2]}}}
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({PREFIX + k: v.contiguous() for k, v in TinyVLAModel(arch).state_dict().items()},
              str(out / "model.safetensors"))
    return out


def _run_folder_damages(export: Path) -> dict[str, tuple[str, object]]:
    cfg = json.loads((export / "config.json").read_text())
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))
    return {
        "recipe.yaml a list": ("recipe.yaml", "- 1\n- 2\n"),
        "recipe.yaml an alias bomb": ("recipe.yaml", bomb + "data: {task: push}\n"),
        "recipe.yaml 20k nested": ("recipe.yaml", "data: " + "[" * 20_000 + "]" * 20_000 + "\n"),
        "recipe.yaml not YAML": ("recipe.yaml", "data: [unclosed\n"),
        "recipe.yaml binary": ("recipe.yaml", b"\xff\xfe\x00\x01"),
        "recipe.yaml data a list": ("recipe.yaml", "data: [1, 2]\n"),
        "recipe.yaml record a string": ("recipe.yaml", "data: {record: pusht}\n"),
        "recipe.yaml seed a string": ("recipe.yaml", "data: {record: {env: pusht, seed: x}}\n"),
        "recipe.yaml task a number": ("recipe.yaml", "data: {task: 5}\n"),
        "recipe.yaml a directory": ("recipe.yaml", "DIR"),
        "config.json a list": ("hf/config.json", "[1, 2]"),
        "config.json not JSON": ("hf/config.json", "{not json"),
        "config.json NaN": ("hf/config.json", json.dumps({**cfg, "chunk_size": 1})[:-1] + ', "x": NaN}'),
        "config.json 100k nested": ("hf/config.json", "[" * 100_000 + "]" * 100_000),
        "config.json 70 nested": ("hf/config.json", json.dumps({**cfg, "x": json.loads("[" * 70 + "]" * 70)})),
        "config.json 20 MB": ("hf/config.json", "SPARSE"),
        "config.json a FIFO": ("hf/config.json", "FIFO"),
        "config.json type unknown": ("hf/config.json", json.dumps({**cfg, "type": "nope"})),
        "config.json type a list": ("hf/config.json", json.dumps({**cfg, "type": ["loongforge_tiny_vla"]})),
        "config.json input_features a list": ("hf/config.json", json.dumps({**cfg, "input_features": [1]})),
        "config.json camera_keys a string": ("hf/config.json", json.dumps({**cfg, "camera_keys": "cam"})),
        "config.json state_dim disagrees": ("hf/config.json", json.dumps({**cfg, "state_dim": 7})),
        "config.json image_size disagrees": ("hf/config.json", json.dumps({**cfg, "image_size": 32})),
        "config.json hidden 2**20": ("hf/config.json", json.dumps({**cfg, "lm_hidden": 2**20, "expert_hidden": 2**20})),
        "config.json 100k layers": ("hf/config.json", json.dumps({**cfg, "vision_layers": 100_000})),
        "config.json 10**9 layers": ("hf/config.json", json.dumps({**cfg, "lm_layers": 10**9})),
        "config.json a size 2**40": ("hf/config.json", json.dumps({**cfg, "max_text_tokens": 2**40})),
        "config.json a size a string": ("hf/config.json", json.dumps({**cfg, "chunk_size": "8"})),
        "config.json a size negative": ("hf/config.json", json.dumps({**cfg, "action_dim": -2})),
        "model.safetensors truncated": ("hf/model.safetensors", "TRUNCATE"),
        "model.safetensors empty": ("hf/model.safetensors", b""),
        "model.safetensors garbage": ("hf/model.safetensors", os.urandom(64)),
        "model.safetensors a tensor missing": ("hf/model.safetensors", "DROP"),
    }


def _damage(run: Path, rel: str, what) -> None:
    path = run / rel
    if what == "DIR":
        path.mkdir()
    elif what == "FIFO":
        path.unlink()
        os.mkfifo(path)
    elif what == "SPARSE":
        with open(path, "wb") as f:
            f.truncate(20 * 2**20)
    elif what == "TRUNCATE":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif what == "DROP":
        from safetensors.torch import load_file, save_file

        sd = load_file(str(path))
        sd.pop(sorted(sd)[len(sd) // 2])
        save_file(sd, str(path))
    else:
        path.write_bytes(what if isinstance(what, bytes) else what.encode())


def test_corrupt_run_folders_are_one_line_naming_the_file(export, tmp_path, capsys):
    import shutil

    from loongforge.errors import LoongForgeError
    from loongforge_embodied.eval.launch import build_policy

    damages = _run_folder_damages(export)
    failures = []
    for i, (name, (rel, what)) in enumerate(damages.items()):
        run = tmp_path / f"run{i}"
        shutil.copytree(export, run / "hf")
        _damage(run, rel, what)
        try:
            build_policy(str(run), [], policy=None, env=None, device="cpu")
            failures.append((name, "accepted"))
        except LoongForgeError as exc:
            text = str(exc)
            if "\n" in text or rel.split("/")[-1] not in text:
                failures.append((name, text[:300]))
        except Exception as exc:  # noqa: BLE001 - recorded as a failure of the contract
            failures.append((name, f"{type(exc).__name__}: {str(exc)[:200]}"))
    assert failures == [], failures
    names = list(damages)  # a few again through the command line: exit 2, one line
    for i in map(names.index, ("recipe.yaml a list", "config.json a list", "model.safetensors truncated")):
        for command in (["eval", str(tmp_path / f"run{i}"), "--episodes", "1", "--videos", "0"],
                        ["serve", str(tmp_path / f"run{i}"), "--port", "0"]):
            rc, err = _cli(capsys, *command, "--device", "cpu")
            assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), (i, command[0], err)
    ok = tmp_path / "ok"
    shutil.copytree(export, ok / "hf")
    (ok / "recipe.yaml").write_text("data: {task: push the block, record: {env: pusht, seed: 3}}\n")
    policy, env, _, _ = build_policy(str(ok), [], policy=None, env=None, device="cpu")
    assert env == "pusht" and policy.task == "push the block" and policy.prompt == "optional"
    (reply,) = policy.infer_batch([{**_good(), "observation.image": np.zeros((64, 64, 3), np.uint8)}])
    assert reply["actions"].shape == (policy.model.arch.chunk_size, 2) and np.isfinite(reply["actions"]).all()


def test_request_timeout_and_counts_are_checked_by_evaluate():
    from loongforge.errors import LoongForgeError, RecipeError
    from loongforge.recipe import load_recipe
    from loongforge_embodied.eval.evaluate import check_counts

    synthetic = ROOT / "recipes" / "embodied" / "tiny_vla_synthetic.yaml"
    assert load_recipe(synthetic).data.eval_request_timeout == 120.0
    for value in ("nan", "inf", "0", "-1", "x"):
        with pytest.raises(RecipeError, match="key 'data.eval_request_timeout'"):
            load_recipe(synthetic, [f"data.eval_request_timeout={value}"])
    base = {"episodes": 1, "workers": 1, "max_steps": None, "replan": None, "videos": 0, "request_timeout_s": 5.0}
    check_counts(**base)
    for key, value in (("max_steps", -5), ("replan", 0), ("replan", -1), ("episodes", True),
                       ("request_timeout_s", math.nan), ("request_timeout_s", 0)):
        with pytest.raises(LoongForgeError) as err:
            check_counts(**{**base, key: value})
        assert "\n" not in str(err.value)

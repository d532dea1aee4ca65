"""The policy protocol's messages, decoded and checked the same way by the server and by our client.

OpenPI's protocol: the client sends a msgpack map of numpy arrays (``openpi_client.msgpack_numpy``) and gets a
map back, ``{"actions": (T, action_dim)}`` here; an error is a text frame (``WebsocketClientPolicy.infer``
raises it as ``RuntimeError``). The keys are the policy's input features (LeRobot names, e.g.
``observation.image`` as uint8 (H, W, 3), ``observation.state`` as float (S,)) and an optional ``prompt``.

NOTE: ``openpi_client.msgpack_numpy.unpackb`` builds whatever array a frame describes: dtype ``|O`` gives an
object array whose elements are pointers taken from the sender's bytes, and touching one crashes the reader
(SIGSEGV). :func:`unpack` is the only decoder used on either side: bool / integer / float arrays only, shapes
and sizes bounded, the data's length equal to what the shape and dtype say; anything else is one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from loongforge.errors import LoongForgeError

PROMPT = "prompt"
PROMPT_MODES = ("required", "optional", "ignored")
MAX_FRAME_BYTES = 256 * 2**20  # a frame either way (a request of several 224x224 cameras is under 1 MiB)
MAX_NDIM = 8
MAX_DIM = 2**31 - 1
MAX_PROMPT_CHARS = 10_000
MAX_FEATURE_DIM = 65_536  # one dimension of a feature the server declares (an image side, a state size)
MAX_CHUNK = 100_000  # actions in one reply
ALLOWED_KINDS = {"b": "bool", "i": "integer", "u": "unsigned integer", "f": "float"}


class ProtocolError(LoongForgeError, ValueError):
    """A frame of the policy protocol that is malformed or not allowed; the message is one line."""


class RequestError(ProtocolError):
    """A malformed request: the message names the key, what came and what is allowed."""


def _dtype(value: Any) -> np.dtype:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str) or not value or len(value) > 8:
        raise ProtocolError(f"an array's dtype must be a short numpy dtype string such as '<f4' "
                            f"(got {str(value)[:40]!r})")
    try:
        dt = np.dtype(value)
    except (TypeError, ValueError):
        raise ProtocolError(f"an array has dtype {value!r}, which numpy does not know") from None
    if dt.kind not in ALLOWED_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise ProtocolError(f"an array has dtype {value!r}; allowed: {', '.join(ALLOWED_KINDS.values())} arrays "
                            "(never object, string, void or structured ones)")
    return dt


def _ndarray(obj: dict) -> np.ndarray:
    dt = _dtype(obj.get(b"dtype"))
    shape, data = obj.get(b"shape"), obj.get(b"data")
    if (not isinstance(shape, list | tuple) or len(shape) > MAX_NDIM
            or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)):
        raise ProtocolError(f"an array's shape must be at most {MAX_NDIM} non-negative integers "
                            f"(got {str(shape)[:60]})")
    if not isinstance(data, bytes):
        raise ProtocolError(f"an array's data must be bytes (got {type(data).__name__})")
    if math.prod(shape) * dt.itemsize != len(data):
        raise ProtocolError(f"an array of shape {tuple(shape)} and dtype {dt.str} needs "
                            f"{math.prod(shape) * dt.itemsize} bytes; the frame holds {len(data)}")
    return np.frombuffer(data, dtype=dt).reshape(shape)


def _generic(obj: dict) -> np.generic:
    dt = _dtype(obj.get(b"dtype"))
    data = obj.get(b"data")
    if not isinstance(data, bool | int | float):
        raise ProtocolError(f"a numpy scalar's value must be a number (got {type(data).__name__})")
    try:
        return dt.type(data)
    except (OverflowError, TypeError, ValueError):
        raise ProtocolError(f"a numpy scalar {str(data)[:40]} does not fit dtype {dt.str}") from None


def _object_hook(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        return _ndarray(obj)
    if b"__npgeneric__" in obj:
        return _generic(obj)
    return obj


def _ext_hook(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not part of the protocol")


def unpack(message: Any, *, what: str) -> Any:
    """Decode one binary frame (``what``: "request", "server reply", ...) with numpy arrays restricted as the
    module says; raises :class:`ProtocolError` with one line."""
    import msgpack

    if isinstance(message, str):
        raise ProtocolError(f"a {what} is a binary msgpack frame (openpi_client.msgpack_numpy), not text")
    if not isinstance(message, bytes | bytearray | memoryview):
        raise ProtocolError(f"a {what} is a binary msgpack frame (got {type(message).__name__})")
    if len(message) > MAX_FRAME_BYTES:
        raise ProtocolError(f"a {what} of {len(message):,} bytes is larger than allowed ({MAX_FRAME_BYTES:,})")
    try:
        return msgpack.unpackb(message, object_hook=_object_hook, ext_hook=_ext_hook, raw=False,
                               strict_map_key=True)
    except ProtocolError as exc:
        raise ProtocolError(f"{what}: {exc}") from None
    except msgpack.StackError:
        raise ProtocolError(f"not a msgpack {what} (nested too deeply)") from None
    except (ValueError, TypeError, KeyError, OverflowError, RecursionError, MemoryError,
            msgpack.UnpackException) as exc:
        first = (str(exc).splitlines() or [""])[0][:200]
        raise ProtocolError(f"not a msgpack {what} ({type(exc).__name__}: {first})") from None


def _count(value: Any, *, at_least: int) -> bool:
    return type(value) is int and value >= at_least


def check_metadata(meta: Any) -> dict[str, Any]:
    """The map a server sends on connect: ``features`` (name → ``{"shape", "dtype"}``), ``prompt`` and the
    chunk sizes checked, so a worker never sizes an environment or a request from a bogus value."""
    if not isinstance(meta, dict):
        raise ProtocolError(f"the server's metadata is a map (got {type(meta).__name__})")
    feats = meta.get("features")
    if not isinstance(feats, dict) or not feats:
        raise ProtocolError("the server's metadata has no 'features' map (name -> {shape, dtype})")
    for name, f in feats.items():
        if not isinstance(name, str) or not name or len(name) > 200:
            raise ProtocolError(f"the server's metadata names a feature {str(name)[:60]!r}; names are short strings")
        shape = f.get("shape") if isinstance(f, dict) else None
        if (not isinstance(shape, list) or not 1 <= len(shape) <= 3
                or not all(type(d) is int and 1 <= d <= MAX_FEATURE_DIM for d in shape)):
            raise ProtocolError(f"the server's metadata: feature '{name}' has shape {str(shape)[:60]}; allowed: "
                                f"1 to 3 sizes, each 1..{MAX_FEATURE_DIM}")
        if f.get("dtype") not in ("uint8", "float"):
            raise ProtocolError(f"the server's metadata: feature '{name}' has dtype {str(f.get('dtype'))[:40]!r}; "
                                "allowed: uint8, float")
        if f["dtype"] == "uint8" and (len(shape) != 3 or shape[2] != 3 or shape[0] != shape[1]):
            raise ProtocolError(f"the server's metadata: image feature '{name}' has shape {shape}; allowed: "
                                "(S, S, 3)")
    if meta.get("prompt", "ignored") not in PROMPT_MODES:
        raise ProtocolError(f"the server's metadata has prompt {str(meta.get('prompt'))[:40]!r}; allowed: "
                            f"{', '.join(PROMPT_MODES)}")
    for key, least in (("n_action_steps", 0), ("action_dim", 1), ("chunk_size", 0)):  # NOTE: 0: chunks vary
        if meta.get(key) is not None and not (_count(meta[key], at_least=least) and meta[key] <= MAX_CHUNK):
            raise ProtocolError(f"the server's metadata has {key} {str(meta[key])[:40]}; allowed: an integer "
                                f"{least}..{MAX_CHUNK}")
    for key in ("policy", "task"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise ProtocolError(f"the server's metadata has a {key} that is not a string")
    return meta


def check_reply(reply: Any, *, action_dim: int | None = None) -> dict[str, np.ndarray]:
    """A reply ``{"actions": (T, action_dim)}`` with finite values; returns it with the actions as float32."""
    actions = reply.get("actions") if isinstance(reply, dict) else None
    if not isinstance(actions, np.ndarray):
        raise ProtocolError(f"the server's reply has no 'actions' array (got {type(reply).__name__} with "
                            f"{type(actions).__name__} actions)")
    if actions.ndim != 2 or not 1 <= actions.shape[0] <= MAX_CHUNK or actions.shape[1] < 1:
        raise ProtocolError(f"the server's reply has actions of shape {actions.shape}; expected (T, action_dim)")
    if action_dim is not None and actions.shape[1] != action_dim:
        raise ProtocolError(f"the server's reply has actions of shape {actions.shape}; its metadata says "
                            f"action_dim {action_dim}")
    actions = actions.astype(np.float32)
    if not np.isfinite(actions).all():
        raise ProtocolError("the server's reply holds NaN or inf actions")
    return {**reply, "actions": actions}


@dataclass(frozen=True)
class Feature:
    """One array the policy reads: its shape and dtype kind (``uint8`` or ``float``)."""

    shape: tuple[int, ...]
    kind: str  # "uint8" | "float"

    def describe(self) -> str:
        return f"{self.kind} {tuple(self.shape)}"

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.kind}


def image(height: int, width: int) -> Feature:
    return Feature((height, width, 3), "uint8")


def vector(dim: int) -> Feature:
    return Feature((dim,), "float")


def check_request(obs: Any, spec: dict[str, Feature], *, prompt: str) -> dict[str, Any]:
    """``obs`` against ``spec``; returns the arrays (floats as float32) and the prompt. ``prompt`` is
    ``"required"``, ``"optional"`` or ``"ignored"``. Raises :class:`RequestError`."""
    if not isinstance(obs, dict):
        raise RequestError(f"a request is a map of observation arrays (got {type(obs).__name__})")
    allowed = sorted(spec) + ([] if prompt == "ignored" else [PROMPT])
    extra = sorted(k for k in obs if k not in spec and k != PROMPT)
    missing = sorted(k for k in spec if k not in obs)
    if missing or extra:
        what = "; ".join(filter(None, [missing and f"missing {', '.join(map(repr, missing))}",
                                       extra and f"unexpected {', '.join(map(repr, map(str, extra)))}"]))
        raise RequestError(f"{what}; the policy takes: {', '.join(allowed)}")
    out: dict[str, Any] = {}
    for key, feat in spec.items():
        value = obs[key]
        if not isinstance(value, np.ndarray):
            raise RequestError(f"'{key}' must be a numpy array {feat.describe()} (got {type(value).__name__})")
        if tuple(value.shape) != tuple(feat.shape):
            raise RequestError(f"'{key}' has shape {tuple(value.shape)}; expected {feat.describe()}")
        if feat.kind == "uint8" and value.dtype != np.uint8:
            raise RequestError(f"'{key}' has dtype {value.dtype}; expected {feat.describe()} (images are uint8)")
        if feat.kind == "float":
            if value.dtype.kind != "f":
                raise RequestError(f"'{key}' has dtype {value.dtype}; expected {feat.describe()}")
            value = value.astype(np.float32)
            if not np.isfinite(value).all():
                raise RequestError(f"'{key}' holds NaN or inf")
        out[key] = value
    text = obs.get(PROMPT)
    if prompt == "required" and text is None:
        raise RequestError(f"missing '{PROMPT}' (the task instruction); the policy takes: {', '.join(allowed)}")
    if text is not None and not isinstance(text, str):
        raise RequestError(f"'{PROMPT}' must be a string (got {type(text).__name__})")
    if text is not None and len(text) > MAX_PROMPT_CHARS:
        raise RequestError(f"'{PROMPT}' has {len(text):,} characters; at most {MAX_PROMPT_CHARS:,}")
    if prompt == "required" and not (text or "").strip():
        raise RequestError(f"'{PROMPT}' is empty; this policy was exported without its task, so every request "
                           "carries the task instruction")
    if text is not None:
        out[PROMPT] = text
    return out

"""The evaluation's client of a policy server: ``openpi-client``'s ``WebsocketClientPolicy`` with limits.

It sends what openpi-client sends (``openpi_client.msgpack_numpy``'s packer) and reads the same frames, but every
frame from the server goes through :func:`~loongforge_embodied.eval.protocol.unpack` and is checked (metadata,
reply), and every wait has a deadline: a server that sends an object array, a NaN action or nothing at all
costs one episode a one-line error, never the worker process or a hang.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from loongforge_embodied.eval.protocol import (
    MAX_FRAME_BYTES,
    ProtocolError,
    check_metadata,
    check_reply,
    unpack,
)

DEFAULT_TIMEOUT_S = 120.0  # NOTE: a first batch of a large policy on a CPU takes tens of seconds


class PolicyClient:
    """A connection to the server at ``address`` (``ws://HOST:PORT``); :attr:`metadata` is its checked metadata.

    ``timeout_s`` bounds the connect and each reply. After any error the connection is closed (a late reply
    must never be taken for the answer to the next request): make a new client."""

    def __init__(self, address: str, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        import websockets.exceptions
        import websockets.sync.client
        from openpi_client import msgpack_numpy

        self.address, self.timeout_s = address, timeout_s
        self._packer = msgpack_numpy.Packer()
        try:
            self._ws = websockets.sync.client.connect(address, compression=None, max_size=MAX_FRAME_BYTES,
                                                      open_timeout=timeout_s, close_timeout=1)
        except (OSError, TimeoutError, websockets.exceptions.WebSocketException, ValueError) as exc:
            first = (str(exc).splitlines() or [""])[0][:200]
            raise ProtocolError(f"no policy server at {address} ({type(exc).__name__}: {first})") from None
        try:
            self.metadata = check_metadata(unpack(self._recv("its metadata"), what="server metadata"))
        except ProtocolError:
            self.close()
            raise

    def _recv(self, what: str) -> Any:
        import websockets.exceptions

        try:
            return self._ws.recv(timeout=self.timeout_s)
        except TimeoutError:
            self.close()
            raise ProtocolError(f"the policy server at {self.address} sent no {what} within {self.timeout_s:g} s "
                                "(the request timeout: --request-timeout)") from None
        except websockets.exceptions.ConnectionClosed as exc:
            self.close()
            reason = f" ({exc.rcvd.code}: {exc.rcvd.reason})" if exc.rcvd is not None and exc.rcvd.reason else ""
            raise ProtocolError(f"the policy server at {self.address} closed the connection before sending "
                                f"{what}{reason}") from None

    def infer(self, obs: dict[str, Any]) -> dict[str, np.ndarray]:
        """One request → ``{"actions": (T, action_dim) float32}``, finite; an error frame is raised as one line."""
        import websockets.exceptions

        try:
            self._ws.send(self._packer.pack(obs))
        except websockets.exceptions.ConnectionClosed:
            self.close()
            raise ProtocolError(f"the policy server at {self.address} closed the connection") from None
        reply = self._recv("a reply")
        if isinstance(reply, str):
            first = (reply.splitlines() or [""])[0][:500]
            raise ProtocolError(f"the policy server refused the request: {first}")
        try:
            return check_reply(unpack(reply, what="server reply"), action_dim=self.metadata.get("action_dim"))
        except ProtocolError:
            self.close()
            raise

    def close(self) -> None:
        try:
            self._ws.close()
        except Exception:  # noqa: BLE001 - closing a connection that already failed
            pass

    def __enter__(self) -> PolicyClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

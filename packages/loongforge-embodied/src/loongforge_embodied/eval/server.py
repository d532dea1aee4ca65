"""``loongforge serve``: a policy behind OpenPI's websocket + msgpack protocol, batching concurrent requests.

Speaks what ``openpi_client.websocket_client_policy.WebsocketClientPolicy`` expects, as OpenPI's own
``WebsocketPolicyServer`` does: on connect a msgpack map of metadata, then one reply per request (a msgpack map,
or a text frame holding the error, which the client raises as ``RuntimeError``); ``GET /healthz`` answers 200.
Unlike OpenPI's server, a malformed request (wrong keys, shapes, dtypes, an empty required prompt, not msgpack,
an array that is not bool / integer / float) gets its error as a one-line text frame and the connection stays
open. Requests arriving together from several connections are run as one batch (up to ``max_batch``, waiting at
most ``batch_wait_s`` for more) on one inference thread; when the policy fails on a batch, each of its requests
is run alone, so the request that fails gets its own one-line error and the others their actions. A traceback
goes to the server's log, never to a client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http
import logging
import threading
import time
from typing import Any

import numpy as np
from loongforge.errors import LoongForgeError

from loongforge_embodied.eval.protocol import MAX_FRAME_BYTES, ProtocolError, check_request, unpack
from loongforge_embodied.eval.served_policy import ServedPolicy

log = logging.getLogger(__name__)


class PolicyServer:
    """Serve ``policy`` on ``host:port`` (port 0: a free one, see :attr:`port` after :meth:`start`)."""

    def __init__(self, policy: ServedPolicy, *, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 16,
                 batch_wait_s: float = 0.002):
        self.policy, self.host, self.port = policy, host, port
        self.max_batch, self.batch_wait_s = max(1, max_batch), batch_wait_s
        self.stats = {"requests": 0, "batches": 0, "errors": 0, "max_batch_seen": 0}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._on_ready = None
        # NOTE: one inference thread: a torch model is not re-entrant, and batching is what buys throughput.
        self._infer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy-infer")

    @property
    def address(self) -> str:
        return f"ws://{self.host}:{self.port}"

    # ----------------------------------------------------------------- lifecycle
    def serve_forever(self, *, on_ready=None) -> None:
        """Serve in this thread until interrupted; ``on_ready()`` is called once the port is bound."""
        self._on_ready = on_ready
        try:
            asyncio.run(self._main())
        except OSError as exc:
            if self._failure is None:
                raise  # NOTE: not a bind failure: it came while serving
            raise self._bind_error(exc) from None

    def _bind_error(self, exc: BaseException) -> LoongForgeError:
        why = getattr(exc, "strerror", None) or (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        return LoongForgeError(f"cannot serve on {self.host}:{self.port} ({why}); pick another --port (0: a free "
                               "one) or --host")

    def start(self, timeout_s: float = 30.0) -> PolicyServer:
        """Serve from a background thread; returns once the port is bound."""
        self._thread = threading.Thread(target=self._run_quietly, name="policy-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise LoongForgeError(f"the policy server did not start on {self.host}:{self.port} in {timeout_s:g} s")
        if self._failure is not None:
            raise self._bind_error(self._failure)
        return self

    def _run_quietly(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException:  # noqa: BLE001 - recorded in self._failure; start() reports it
            pass

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._infer.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> PolicyServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _main(self) -> None:
        import websockets.asyncio.server as ws_server

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._queue: asyncio.Queue = asyncio.Queue()
        batcher = asyncio.create_task(self._batcher())
        try:
            async with ws_server.serve(self._handler, self.host, self.port, compression=None,
                                       max_size=MAX_FRAME_BYTES, process_request=_health_check) as server:
                self.port = server.sockets[0].getsockname()[1]
                self._ready.set()
                if self._on_ready is not None:
                    self._on_ready()
                await self._stop.wait()
        except BaseException as exc:
            if not self._ready.is_set():  # NOTE: a failure to bind (start() and serve_forever() report it)
                self._failure = exc
                self._ready.set()
            raise
        finally:
            batcher.cancel()

    # ----------------------------------------------------------------- connections
    async def _handler(self, websocket) -> None:
        import websockets
        from openpi_client import msgpack_numpy

        packer = msgpack_numpy.Packer()
        await websocket.send(packer.pack(self.policy.metadata()))
        while True:
            try:
                message = await websocket.recv()
            except websockets.ConnectionClosed:
                return
            try:
                request = self._decode(message)
            except ProtocolError as exc:
                self.stats["errors"] += 1
                text = f"error: {exc}"
            else:
                future = self._loop.create_future()
                await self._queue.put((request, future))
                try:
                    text = packer.pack(_checked_reply(await future))
                except Exception as exc:  # noqa: BLE001 - one line to the client; the traceback is in the log
                    self.stats["errors"] += 1
                    first = (str(exc).splitlines() or [""])[0][:300]
                    text = (f"error: the policy failed on this request ({type(exc).__name__}: {first}); the "
                            "server's log has the traceback")
            try:
                await websocket.send(text)
            except websockets.ConnectionClosed:
                return

    def _decode(self, message: Any) -> dict[str, Any]:
        return check_request(unpack(message, what="request"), self.policy.spec, prompt=self.policy.prompt)

    # ----------------------------------------------------------------- batching
    async def _batcher(self) -> None:
        while True:
            batch = [await self._queue.get()]
            deadline = time.monotonic() + self.batch_wait_s
            while len(batch) < self.max_batch:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), timeout))
                except TimeoutError:
                    break
            requests = [r for r, _ in batch]
            self.stats["batches"] += 1
            self.stats["requests"] += len(batch)
            self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(batch))
            try:
                replies = await self._loop.run_in_executor(self._infer, self._infer_batch, requests)
            except Exception as exc:  # noqa: BLE001 - isolated below, request by request
                if len(batch) == 1:
                    log.error("policy %s failed on a request", self.policy.name, exc_info=exc)
                    replies = [exc]
                else:
                    # NOTE: one bad request must not fail the requests batched with it: run each alone
                    log.warning("policy %s failed on a batch of %d (%s: %s); running each request alone",
                                self.policy.name, len(batch), type(exc).__name__, exc)
                    replies = []
                    for request in requests:
                        try:
                            (reply,) = await self._loop.run_in_executor(self._infer, self._infer_batch, [request])
                        except Exception as one:  # noqa: BLE001 - sent as this request's one-line error
                            log.error("policy %s failed on a request", self.policy.name, exc_info=one)
                            reply = one
                        replies.append(reply)
            for (_, fut), reply in zip(batch, replies, strict=True):
                if fut.done():
                    continue
                if isinstance(reply, BaseException):
                    fut.set_exception(reply)
                else:
                    fut.set_result(reply)

    def _infer_batch(self, requests: list[dict[str, Any]]) -> list[Any]:
        replies = self.policy.infer_batch(requests)
        if not isinstance(replies, list | tuple) or len(replies) != len(requests):
            raise RuntimeError(f"{self.policy.name} answered {len(replies) if isinstance(replies, list | tuple) else 0}"
                               f" of {len(requests)} requests")
        return list(replies)


def _checked_reply(reply: Any) -> dict[str, Any]:
    """What a policy answered, as the protocol allows it back: a map with an ``actions`` array of numbers."""
    actions = reply.get("actions") if isinstance(reply, dict) else None
    if not isinstance(actions, np.ndarray) or actions.dtype.kind not in "biuf" or actions.ndim != 2:
        raise RuntimeError(f"the policy answered {type(reply).__name__} without an (T, action_dim) 'actions' array")
    return reply


def _health_check(connection, request):
    if request.path == "/healthz":
        return connection.respond(http.HTTPStatus.OK, "OK\n")
    return None

"""``loongforge serve``: a policy behind OpenPI's websocket + msgpack protocol, batching concurrent requests.

Speaks what ``openpi_client.websocket_client_policy.WebsocketClientPolicy`` expects, as OpenPI's own
``WebsocketPolicyServer`` does: on connect a msgpack map of metadata, then one reply per request (a msgpack map,
or a text frame holding the error, which the client raises as ``RuntimeError``); ``GET /healthz`` answers 200.
Unlike OpenPI's server, a malformed request (wrong keys, shapes, dtypes, not msgpack) gets its error as a text
frame and the connection stays open; only a failure inside the policy closes the connection (code 1011), and the
server goes on serving other clients either way. Requests arriving together from several connections are run
as one batch (up to ``max_batch``, waiting at most ``batch_wait_s`` for more) on one inference thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http
import logging
import threading
import time
import traceback
from typing import Any

from loongforge_embodied.eval.protocol import RequestError, check_request
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
        # NOTE: one inference thread: a torch model is not re-entrant, and batching is what buys throughput.
        self._infer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy-infer")

    @property
    def address(self) -> str:
        return f"ws://{self.host}:{self.port}"

    # ----------------------------------------------------------------- lifecycle
    def serve_forever(self) -> None:
        """Serve in this thread until interrupted."""
        asyncio.run(self._main())

    def start(self, timeout_s: float = 30.0) -> PolicyServer:
        """Serve from a background thread; returns once the port is bound."""
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="policy-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._failure is not None:
            raise RuntimeError(f"policy server did not start on {self.host}:{self.port}: {self._failure}")
        return self

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
            async with ws_server.serve(self._handler, self.host, self.port, compression=None, max_size=None,
                                       process_request=_health_check) as server:
                self.port = server.sockets[0].getsockname()[1]
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self._failure = exc
            self._ready.set()
            raise
        finally:
            batcher.cancel()

    # ----------------------------------------------------------------- connections
    async def _handler(self, websocket) -> None:
        import websockets
        import websockets.frames
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
            except RequestError as exc:
                self.stats["errors"] += 1
                await websocket.send(f"error: {exc}")
                continue
            future = self._loop.create_future()
            await self._queue.put((request, future))
            try:
                reply = await future
            except Exception:
                self.stats["errors"] += 1
                await websocket.send(f"error: the policy failed on this request\n{traceback.format_exc()}")
                await websocket.close(code=websockets.frames.CloseCode.INTERNAL_ERROR,
                                      reason="policy failure; traceback in the previous frame")
                return
            try:
                await websocket.send(packer.pack(reply))
            except websockets.ConnectionClosed:
                return

    def _decode(self, message: Any) -> dict[str, Any]:
        from openpi_client import msgpack_numpy

        if isinstance(message, str):
            raise RequestError("requests are binary msgpack frames (openpi_client.msgpack_numpy), not text")
        try:
            obs = msgpack_numpy.unpackb(message)
        except Exception as exc:
            raise RequestError(f"not a msgpack request ({type(exc).__name__}: {exc})") from None
        return check_request(obs, self.policy.spec, prompt=self.policy.prompt)

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
                replies = await self._loop.run_in_executor(self._infer, self.policy.infer_batch, requests)
                if len(replies) != len(batch):
                    raise RuntimeError(f"{self.policy.name} answered {len(replies)} of {len(batch)} requests")
            except Exception as exc:
                log.exception("policy %s failed on a batch of %d", self.policy.name, len(batch))
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), reply in zip(batch, replies, strict=True):
                if not fut.done():
                    fut.set_result(reply)


def _health_check(connection, request):
    if request.path == "/healthz":
        return connection.respond(http.HTTPStatus.OK, "OK\n")
    return None

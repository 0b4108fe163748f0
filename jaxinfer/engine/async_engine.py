"""AsyncEngine: the Engine driven by its own thread, with an async-iterator API for servers.

The engine loop sleeps on a condition variable while there is nothing to do and wakes on
a new request or abort: no polling. Requests are added under a lock from a worker thread
(``run_in_executor``), so validation errors (ValueError, QueueFullError) reach the caller
before anything is yielded, and the event loop never waits for a device step. Outputs go
back to each request's asyncio queue through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, AsyncIterator

from jaxinfer.config import RequestOutput, SamplingParams
from jaxinfer.errors import EngineDeadError

log = logging.getLogger("jaxinfer")

_DONE = object()


class AsyncEngine:
    def __init__(self, engine: Any):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.max_num_seqs = engine.config.max_num_seqs
        self._lock = threading.Lock()            # guards the engine (scheduler is not thread-safe)
        self._wake = threading.Condition(self._lock)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self.is_dead = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="jaxinfer-engine", daemon=True)
        self._thread.start()
        self.is_ready = True

    # ---- engine thread --------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stopping and not self.engine.has_unfinished():
                        self._wake.wait()
                    if self._stopping:
                        return
                    outputs = self.engine.step()
                for out in outputs:
                    self._deliver(out.request_id, out)
        except BaseException as e:   # noqa: BLE001 - the loop must report any death
            log.exception("engine loop died")
            self.error, self.is_dead = e, True
            for rid in list(self._queues):
                self._deliver(rid, EngineDeadError(f"engine loop died: {e!r}"))

    def _deliver(self, request_id: str, item: Any) -> None:
        entry = self._queues.get(request_id)
        if entry is None:
            return
        loop, q = entry
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:          # the caller's loop is closed: nobody is listening
            self._queues.pop(request_id, None)

    # ---- caller side ----------------------------------------------------------------
    def _add(self, prompt: Any, params: SamplingParams, request_id: str, priority: int) -> None:
        with self._wake:
            if self.is_dead:
                raise EngineDeadError("engine loop has died")
            self.engine.add_request(prompt, params, request_id, priority)
            self._wake.notify()

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields cumulative outputs as tokens arrive; the last has ``finished=True``.
        Closing the iterator early (client gone, task cancelled) aborts the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        if request_id in self._queues:
            raise ValueError(f"request_id: {request_id!r} is already running")
        self._queues[request_id] = (loop, q)
        added = finished = False
        try:
            await loop.run_in_executor(None, self._add, prompt, params, request_id, priority)
            added = True
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                # Coalesce: if several snapshots queued up, only the newest matters.
                while not q.empty():
                    nxt = q.get_nowait()
                    if isinstance(nxt, BaseException):
                        raise nxt
                    item = nxt
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if added and not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._abort_sync, request_id)

    def _abort_sync(self, request_id: str) -> None:
        with self._wake:
            self.engine.abort(request_id)

    def stats(self) -> dict[str, Any]:
        # Reads plain ints/floats; a slightly stale snapshot is fine for metrics.
        return self.engine.stats()

    def warmup_status(self) -> dict[str, Any] | None:
        """The engine's bucket compilation progress (Engine.warmup_status), for /health."""
        get = getattr(self.engine, "warmup_status", None)
        return get() if get is not None else None

    async def shutdown(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:          # releases follower processes of a multi-process engine
            stop()

"""AsyncEngine: the Engine driven by its own thread, with an async-iterator API for servers.

Only the engine thread touches the engine. Callers put "add" and "abort" commands in an
inbox under a lock held for an append, never across a step, so adding or aborting a
request returns at once however long the step in flight takes; the loop drains the inbox
between steps. The loop sleeps on a condition variable while there is nothing to do and
wakes on a command: no polling.

Tokenization and chat templating run in a worker thread, off the caller's event loop and
off the engine thread; a request's grammar compiles in the engine's grammar threads
(guided.GrammarCompiler, within its time budget) before the request is posted. A bad prompt raises ValueError from ``generate`` before anything is
yielded; errors found when the engine adds the request (too long, queue full) arrive the
same way, through the request's queue.

Admission control (engine/admission.py) runs on the caller's side too: ``generate``
refuses a request whose predicted wait for its first token is over the bound
(QueueFullError) before posting it, reading the prefill rate the engine thread measures
around each step; a refused request never reaches the engine. A non-zero priority is
checked against the scheduling policy there as well (ValueError under "fcfs").

The engine hands out deltas (``Engine.step(deltas=True)``: only what is new, O(new) per
step); each request's cumulative output is grown from them on the caller's side, where
the API needs it, instead of copying every request's whole output every step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable

from jaxinfer.engine.admission import Admission
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.errors import EngineDeadError, RequestFailedError, StepFailedError

log = logging.getLogger("jaxinfer")


class _Cumulative:
    """One request's output so far, grown in place from the engine's deltas."""

    __slots__ = ("out",)

    def __init__(self) -> None:
        self.out: RequestOutput | None = None

    def apply(self, delta: RequestOutput, prompt_text: str | None) -> RequestOutput:
        out = self.out
        if out is None:
            outs = [CompletionOutput(d.index, d.text, list(d.token_ids), d.finish_reason, d.stop_reason,
                                     None if d.logprobs is None else list(d.logprobs), d.cumulative_logprob,
                                     d.beam_score)
                    for d in delta.outputs]
            out = self.out = RequestOutput(delta.request_id, prompt_text, delta.prompt_token_ids, outs,
                                           delta.finished, delta.metrics, delta.prompt_logprobs)
            return out
        for o, d in zip(out.outputs, delta.outputs):
            o.text += d.text
            o.token_ids.extend(d.token_ids)
            if d.logprobs:
                o.logprobs.extend(d.logprobs)
            o.finish_reason, o.stop_reason = d.finish_reason, d.stop_reason
            o.cumulative_logprob = d.cumulative_logprob
        out.finished, out.metrics = delta.finished, delta.metrics
        return out


class AsyncEngine:
    def __init__(self, engine: Any):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.max_num_seqs = engine.config.max_num_seqs
        self.admission = Admission(engine.config.max_queue_delay_ms, self.max_num_seqs,
                                   engine.config.scheduling_policy)
        self._lock = threading.Lock()            # guards the inbox only; never held across a step
        self._wake = threading.Condition(self._lock)
        self._inbox: list[tuple] = []            # ("add", id, ids, params, priority, lora, grammar) | ("abort", id)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self.is_dead = False
        self.error: BaseException | None = None
        self._on_death: list[Callable[[BaseException], None]] = []
        self._thread = threading.Thread(target=self._loop, name="jaxinfer-engine", daemon=True)
        self._thread.start()
        self.is_ready = True

    # ---- engine thread --------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stopping and not self._inbox and not self.engine.has_unfinished():
                        self._wake.wait()
                    if self._stopping:
                        return
                    inbox, self._inbox = self._inbox, []
                for cmd in inbox:
                    self._run_command(cmd)
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as e:   # noqa: BLE001 - the loop must report any death
            self._die(e)

    def _step(self) -> None:
        """One engine step, its outputs to their callers. A step that failed took only its
        own requests with it (Engine._step_failed): they get the error, the loop goes on."""
        busy = self.admission.busy()
        if busy:
            t0, before = time.monotonic(), self.engine.output.prompt_tokens_total
        try:
            outs = self.engine.step(deltas=True)
            if busy:        # how fast queued prompts drain (admission control's rate)
                self.admission.observe(self.engine.output.prompt_tokens_total - before, time.monotonic() - t0)
        except StepFailedError as e:
            for rid in e.request_ids:
                self._deliver(rid, RequestFailedError(f"the engine failed while running this request "
                                                      f"({type(e.cause).__name__}); other requests are unaffected"))
            return
        for out in outs:
            self._deliver(out.request_id, out)

    def _die(self, e: BaseException) -> None:
        """The loop cannot go on (the device state is lost, or a bug outside any one step):
        fail every request in flight, then tell whoever watches (the server exits non-zero,
        so a supervisor restarts it, instead of answering 503 forever)."""
        log.exception("engine loop died", exc_info=e)
        with self._wake:
            self.error, self.is_dead = e, True
        for rid in list(self._queues):
            self._deliver(rid, EngineDeadError(f"the engine has stopped: {type(e).__name__}"))
        for callback in self._on_death:
            try:
                callback(e)
            except Exception:   # noqa: BLE001 - a watcher's bug must not hide the death
                log.exception("engine death callback failed")

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` (from the engine thread) if the loop dies; at once if it has."""
        with self._wake:
            dead, self._on_death = self.is_dead, self._on_death + [callback]
        if dead:
            callback(self.error)

    def _run_command(self, cmd: tuple) -> None:
        if cmd[0] == "abort":
            self.engine.abort(cmd[1])
            return
        _, request_id, ids, params, priority, lora, grammar = cmd
        if request_id not in self._queues:       # the caller left before the loop got to it
            return
        try:
            self.engine.add_request(ids, params, request_id, priority, **({"lora": lora} if lora else {}),
                                    grammar=grammar)
        except Exception as e:   # noqa: BLE001 - bad input, queue full: the caller's error
            self._deliver(request_id, e)

    def _deliver(self, request_id: str, item: Any) -> None:
        entry = self._queues.get(request_id)
        if entry is None:
            return
        loop, q = entry
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:          # the caller's loop is closed: nobody is listening
            self._queues.pop(request_id, None)

    def _post(self, cmd: tuple) -> None:
        with self._wake:
            if self.is_dead:
                raise EngineDeadError("engine loop has died")
            self._inbox.append(cmd)
            self._wake.notify()

    # ---- caller side ----------------------------------------------------------------
    async def _encode(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, (list, tuple)) and not any(isinstance(x, dict) for x in prompt):
            return self.engine.encode_prompt(prompt)      # token ids: only validated
        return await asyncio.get_running_loop().run_in_executor(None, self.engine.encode_prompt, prompt)

    async def _compile(self, params: SamplingParams) -> Any:
        """The request's grammar, compiled in the engine's grammar threads before the request
        is posted, so the engine thread never waits for a compile (a 64-tool grammar, or the
        first one, which builds llguidance's tokenizer); over a budget: GuidedDecodingError."""
        if params.guided is None:
            return None
        return await self.engine.grammars.compile_async(params.guided)

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str,
                       priority: int = 0, lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields cumulative outputs as tokens arrive; the last has ``finished=True``.

        A yielded output grows in place as later ones arrive (building a fresh copy per step
        is what made streaming quadratic): use it before asking for the next, or copy it.
        Closing the iterator early (client gone, task cancelled) aborts the request.
        ``lora``: a loaded LoRA adapter's name (Engine.add_request). Raises before
        anything is yielded: ValueError (bad input, a priority the policy refuses) or
        QueueFullError (admission control, or the waiting queue is full)."""
        loop = asyncio.get_running_loop()
        if request_id in self._queues:
            raise ValueError(f"request_id: {request_id!r} is already running")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (loop, q)
        posted = finished = finished_queueing = False
        acc = _Cumulative()
        try:
            text, ids = await self._encode(prompt)
            if priority:
                self.engine.check_priority(priority)
            self.admission.enter(request_id, priority, len(ids))     # may refuse: QueueFullError
            grammar = await self._compile(params)
            self._post(("add", request_id, ids, params, priority, lora, grammar))
            posted = True
            while True:
                item = await q.get()
                if not finished_queueing:    # a first output (or error): no longer queued
                    self.admission.leave(request_id)
                    finished_queueing = True
                out = None
                while True:    # apply every delta that queued up, then yield once
                    if isinstance(item, BaseException):
                        if out is None:
                            raise item
                        # tokens that came before the error reach the caller first
                        q.put_nowait(item)
                        break
                    out = acc.apply(item, text)
                    if q.empty():
                        break
                    item = q.get_nowait()
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            self.admission.leave(request_id)
            if posted and not finished:
                self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        try:
            self._post(("abort", request_id))
        except EngineDeadError:
            pass

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id``: returns at once; the engine frees its pages between steps."""
        self._abort_now(request_id)

    async def load_lora(self, name: str, path: str) -> None:
        """Engine.load_lora in a worker thread (reading the files takes a while); the
        registry is thread-safe, so the engine keeps stepping meanwhile."""
        await asyncio.get_running_loop().run_in_executor(None, self.engine.load_lora, name, path)

    async def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    def lora_names(self) -> list[str]:
        return self.engine.lora_names()

    def stats(self) -> dict[str, Any]:
        # Reads plain ints/floats; a slightly stale snapshot is fine for metrics.
        return {**self.engine.stats(), **self.admission.stats()}

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

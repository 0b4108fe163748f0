"""A deterministic stand-in for ``jaxinfer.engine.async_engine.AsyncEngine``, for server tests.

It implements the AsyncEngine interface exactly (tokenizer, model_name, max_model_len,
max_num_seqs, is_ready, is_dead, generate, abort, stats, shutdown) with outputs that can be
worked out by hand, so serving tests run in milliseconds without JAX:

- The tokenizer is character level: token id = ``CharTokenizer.OFFSET + ord(char)``, plus a
  few special tokens (BOS, EOS, chat markers). ``apply_chat_template`` is ChatML.
- A sequence's continuation is the text ``CORPUS`` read from an offset fixed by the prompt
  (greedy) or by (seed, prompt, sample index) (sampled), followed by EOS once the corpus
  ends. ``MockAsyncEngine.continuation`` computes it directly, so tests can compare.
- A background loop plays the engine: waiting -> running (at most ``max_num_seqs``
  sequences), one token per running sequence per step of ``step_time`` seconds. KV pages
  are counted (``page_size`` tokens each) so that aborts and finishes show in ``stats()``.
- Stop strings are held back while they could still match, as a real detokenizer does,
  so the cumulative text only ever grows.

Run as a script it serves itself (``python tests/mock_engine.py --port 8123``), which the
graceful-shutdown test uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator

from jaxinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.errors import EngineDeadError, QueueFullError

CORPUS = ("Once upon a time a small robot learned to paint. It painted the sea, "
          "the sky and the stars, and then it painted itself. ")

# Letters used as the "next most likely" alternatives in fake top-logprobs.
_ALTERNATIVES = "etaoinshrdlu"


class CharTokenizer:
    """One token per Unicode character; ids below OFFSET are special tokens."""

    PAD, BOS, EOS, IM_START, IM_END = 0, 1, 2, 3, 4
    SPECIAL = {0: "<pad>", 1: "<s>", 2: "</s>", 3: "<|im_start|>", 4: "<|im_end|>"}
    OFFSET = 8
    ROLES = ("system", "user", "assistant", "tool")

    eos_token_ids: tuple[int, ...] = (EOS, IM_END)
    vocab_size = OFFSET + 0x110000

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.OFFSET + ord(c) for c in text]
        return [self.BOS] + ids if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            if i < self.OFFSET:
                if not skip_special_tokens:
                    out.append(self.SPECIAL.get(i, "<unk>"))
            elif i < self.vocab_size:
                out.append(chr(i - self.OFFSET))
            else:
                raise ValueError(f"token id {i} is out of range")
        return "".join(out)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            template_kwargs: dict | None = None) -> list[int]:
        if not messages:
            raise ValueError("messages must not be empty")
        ids: list[int] = []
        for i, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if role not in self.ROLES:
                raise ValueError(f"messages[{i}].role: unsupported role {role!r}")
            if not isinstance(content, str):
                raise ValueError(f"messages[{i}].content: must be a string")
            ids += [self.IM_START] + self.encode(f"{role}\n{content}", False) + [self.IM_END]
            ids += self.encode("\n", False)
        if add_generation_prompt:
            ids += [self.IM_START] + self.encode("assistant\n", False)
        return ids


@dataclass
class _Seq:
    index: int
    plan: Iterator[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    visible: str = ""            # text minus a held-back possible stop-string prefix
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    pages: int = 0


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[_Seq]
    metrics: RequestMetrics
    event: asyncio.Event = field(default_factory=asyncio.Event)
    latest: RequestOutput | None = None
    error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class MockAsyncEngine:
    """Deterministic AsyncEngine look-alike; see the module docstring."""

    def __init__(self, *, model_name: str = "mock-model", max_model_len: int = 256,
                 max_num_seqs: int = 8, max_waiting: int = 64, page_size: int = 16,
                 step_time: float = 0.002, ready: bool = True) -> None:
        self.tokenizer = CharTokenizer()
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.page_size = page_size
        self.step_time = step_time
        self.is_ready = ready
        self.is_dead = False
        self.paused = False                # tests: hold every request in the waiting queue
        # Enough pages for every running sequence at full length: the mock never preempts.
        self.num_total_pages = max_num_seqs * math.ceil(max_model_len / page_size)
        self.num_free_pages = self.num_total_pages
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.aborted: list[str] = []       # request ids aborted (abort() or generator closed)
        self.abort_calls: list[str] = []   # every abort request, even for an already finished one
        self.finished: list[str] = []      # request ids that ran to completion
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._requests: dict[str, _Request] = {}
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ interface

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        if self.is_dead:
            raise EngineDeadError("engine loop is dead")
        req = self._new_request(prompt, params, request_id)   # may raise ValueError / QueueFullError
        self._waiting.append(req)
        self._requests[request_id] = req
        self._ensure_loop()
        self._wake.set()
        done = False
        try:
            while True:
                await req.event.wait()
                req.event.clear()
                if req.error is not None:
                    done = True
                    raise req.error
                out = req.latest
                yield out
                if out.finished:
                    done = True
                    return
        finally:
            if not done:      # closed before the end: as AsyncEngine does, abort it
                self.abort_calls.append(request_id)
                self._abort_now(req)

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)
        req = self._requests.get(request_id)
        if req is not None:
            self._abort_now(req)

    def stats(self) -> dict:
        return {
            "num_running": len(self._running),
            "num_waiting": len(self._waiting),
            "kv_cache_usage": 1.0 - self.num_free_pages / self.num_total_pages,
            "num_free_pages": self.num_free_pages,
            "num_total_pages": self.num_total_pages,
            "num_preemptions_total": 0,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
        }

    async def shutdown(self) -> None:
        for req in list(self._requests.values()):
            self._abort_now(req)
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None

    # ------------------------------------------------------------------ test helpers

    def kill(self) -> None:
        """Play a dead engine loop, as AsyncEngine reports one: is_dead turns True and every
        request's generator raises EngineDeadError. Safe to call from any thread."""
        self.is_dead = True
        loop = self._loop_task.get_loop() if self._loop_task is not None else None
        if loop is not None and not loop.is_closed():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not loop:
                done = threading.Event()
                loop.call_soon_threadsafe(lambda: (self._fail_all(), done.set()))
                done.wait(5)
                return
        self._fail_all()

    def _fail_all(self) -> None:
        for req in list(self._requests.values()):
            self._release(req)
            req.error = EngineDeadError("engine loop died")
            req.event.set()

    def continuation(self, prompt_ids: list[int], params: SamplingParams, index: int = 0) -> Iterator[int]:
        """The token ids sequence ``index`` of this prompt would produce, before stop handling."""
        n = len(CORPUS)
        if params.temperature == 0:
            start = sum(prompt_ids) % n
        else:
            key = f"{params.seed}:{index}:{sum(prompt_ids)}" if params.seed is not None else None
            start = random.Random(key).randrange(n)
        pos = start
        while True:
            yield self.tokenizer.OFFSET + ord(CORPUS[pos])
            pos += 1
            if pos == n:
                yield self.tokenizer.EOS
                pos = 0

    def expected_text(self, prompt: str | list[int], params: SamplingParams, index: int = 0,
                      add_special_tokens: bool = True) -> str:
        """The final text generate() gives for this prompt (stop strings, EOS, max_tokens)."""
        ids = prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt, add_special_tokens)
        seq = _Seq(index=index, plan=self.continuation(ids, params, index))
        while seq.finish_reason is None:
            self._advance(seq, params)
        return seq.visible

    # ------------------------------------------------------------------ internals

    def _new_request(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> _Request:
        if not isinstance(params, SamplingParams):
            raise ValueError("params: must be a SamplingParams")
        if isinstance(prompt, str):
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            ids, text = list(prompt), None
            if any(not isinstance(t, int) or t < 0 or t >= self.tokenizer.vocab_size for t in ids):
                raise ValueError("prompt: token ids out of range")
        if not ids:
            raise ValueError("prompt: must not be empty")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} prompt tokens + max_tokens {params.max_tokens} "
                             f"exceed max_model_len {self.max_model_len}")
        if params.n > self.max_num_seqs:
            raise ValueError(f"n: {params.n} exceeds max_num_seqs {self.max_num_seqs}")
        if params.prompt_logprobs is not None:      # as an engine without --enable-prompt-logprobs
            raise ValueError("prompt_logprobs: this engine has no scoring buckets")
        if params.beam_width > 1:
            raise ValueError("beam_width: beam search is not modelled by the mock engine")
        if (params.best_of or params.n) > params.n:
            raise ValueError("best_of: best_of > n is not modelled by the mock engine")
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if len(self._waiting) >= self.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.max_waiting} requests)")
        seqs = [_Seq(index=i, plan=self.continuation(ids, params, i),
                     logprobs=[] if params.logprobs is not None else None) for i in range(params.n)]
        return _Request(request_id, text, ids, params, seqs, RequestMetrics(arrival_time=time.monotonic()))

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            if not self._waiting and not self._running:
                self._wake.clear()
                await self._wake.wait()
                continue
            self._admit()
            await asyncio.sleep(self.step_time)     # the "forward pass"
            self._step()

    def _admit(self) -> None:
        while self._waiting and not self.paused:
            req = self._waiting[0]
            busy = sum(len(r.seqs) for r in self._running)
            need = len(req.seqs) * math.ceil(len(req.prompt_ids) / self.page_size)
            if busy + len(req.seqs) > self.max_num_seqs or need > self.num_free_pages:
                return
            self._waiting.pop(0)
            for s in req.seqs:
                s.pages = math.ceil(len(req.prompt_ids) / self.page_size)
            self.num_free_pages -= need
            self.prompt_tokens_total += len(req.prompt_ids)
            req.metrics.first_scheduled_time = time.monotonic()
            self._running.append(req)

    def _step(self) -> None:
        now = time.monotonic()
        for req in list(self._running):
            for s in req.seqs:
                if s.finish_reason is None:
                    self._advance(s, req.params)
                    self.generation_tokens_total += 1
                    want = math.ceil((len(req.prompt_ids) + len(s.token_ids)) / self.page_size)
                    self.num_free_pages -= want - s.pages
                    s.pages = want
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if req.finished:
                req.metrics.finished_time = now
                self._release(req)
                self.finished.append(req.request_id)
            self._publish(req)

    def _advance(self, s: _Seq, p: SamplingParams) -> None:
        """Append one token to ``s`` and apply EOS / stop token / stop string / length rules."""
        tok = next(s.plan)
        s.token_ids.append(tok)
        if s.logprobs is not None:
            s.logprobs.append(self._fake_logprob(tok, p.logprobs))
        tk = self.tokenizer
        if tok in tk.eos_token_ids and not p.ignore_eos:
            s.finish_reason = "stop"
        elif tok in p.stop_token_ids:
            s.finish_reason, s.stop_reason = "stop", tok
        else:
            prev = len(s.text)
            s.text += tk.decode([tok], skip_special_tokens=p.skip_special_tokens)
            hits = [(s.text.find(stop, max(0, prev - len(stop) + 1)), stop) for stop in p.stop]
            hits = [(i, stop) for i, stop in hits if i >= 0]
            if hits:
                i, stop = min(hits)
                s.text = s.text[:i + len(stop)] if p.include_stop_str_in_output else s.text[:i]
                s.finish_reason, s.stop_reason = "stop", stop
        if s.finish_reason is None and len(s.token_ids) >= p.max_tokens:
            s.finish_reason = "length"
        s.visible = s.text if s.finish_reason else s.text[:len(s.text) - self._held_back(s.text, p.stop)]

    @staticmethod
    def _held_back(text: str, stops: tuple[str, ...]) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def _fake_logprob(self, tok: int, k: int | None) -> Logprob:
        lp = -0.05 - (tok % 7) / 10
        alts = [self.tokenizer.OFFSET + ord(c) for c in _ALTERNATIVES]
        top = [(tok, lp)] + [(a, lp - 0.5 * (j + 1)) for j, a in enumerate(x for x in alts if x != tok)]
        return Logprob(token_id=tok, logprob=lp, top=tuple(top[:k or 0]))

    def _publish(self, req: _Request) -> None:
        outs = [CompletionOutput(index=s.index, text=s.visible, token_ids=list(s.token_ids),
                                 finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                                 logprobs=list(s.logprobs) if s.logprobs is not None else None)
                for s in req.seqs]
        m = req.metrics
        req.latest = RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=list(req.prompt_ids),
            outputs=outs, finished=req.finished,
            metrics=RequestMetrics(m.arrival_time, m.first_scheduled_time, m.first_token_time,
                                   m.finished_time))
        req.event.set()

    def _release(self, req: _Request) -> None:
        if req in self._running:
            self._running.remove(req)
            self.num_free_pages += sum(s.pages for s in req.seqs)
            for s in req.seqs:
                s.pages = 0
        elif req in self._waiting:
            self._waiting.remove(req)
        self._requests.pop(req.request_id, None)

    def _abort_now(self, req: _Request) -> None:
        if self._requests.get(req.request_id) is not req:
            return
        self._release(req)
        self.aborted.append(req.request_id)
        for s in req.seqs:
            if s.finish_reason is None:
                s.finish_reason = "abort"
                s.visible = s.text
        req.metrics.finished_time = time.monotonic()
        self._publish(req)


# ---------------------------------------------------------------------- test server helpers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_in_thread(app, startup_timeout: float = 10.0, **uvicorn_config: Any) -> contextlib.AbstractContextManager[str]:
    """Run ``app`` under a real uvicorn on a free loopback port in a thread; yield its base URL.
    ``uvicorn_config``: more ``uvicorn.Config`` options (e.g. ``http=`` a protocol class)."""
    from jaxinfer.bench.serve import serve_app_in_thread

    return serve_app_in_thread(app, startup_timeout, graceful_s=2, **uvicorn_config)


def _main() -> int:
    """Serve a MockAsyncEngine through serving.server.run_server (graceful-shutdown test)."""
    import argparse

    from serving.server import add_serve_args, serve_main

    parser = argparse.ArgumentParser(description="serve the mock engine")
    add_serve_args(parser)
    parser.add_argument("--step-time", type=float, default=0.01)
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args()
    engine = MockAsyncEngine(step_time=args.step_time, max_model_len=args.max_model_len)
    return serve_main(args, engine)


if __name__ == "__main__":
    raise SystemExit(_main())

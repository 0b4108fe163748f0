"""Bucket compilation at start-up: the buckets a first request needs now, the rest in a
background thread while the engine already serves, or when a step first needs them
(``EngineConfig.warmup``: "background" / "lazy"; "full" compiles all before serving).

Every bucket of every replica is compiled exactly once, in priority order
(``priority_order``). Until all are compiled a step uses the cheapest compiled bucket that
holds it (``BucketLadders.choose(ready=...)``; the tokens are the same in any bucket), or,
when none does, compiles its own bucket first (``ensure``). One lock serializes compiles,
so a bucket the step needs and the background thread's current one are never compiled
twice. Once ``is_warm`` is True nothing compiles again: every bucket is there, and a step
only calls executables (the invariant tests/test_warmup.py asserts).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Any, Callable, Sequence

from jaxinfer.engine.batch import Bucket, BucketLadders
from jaxinfer.host_memory import release_code_pages, trim_heap

log = logging.getLogger("jaxinfer")

_default_mode = "background"


def default_mode() -> str:
    """The warm-up of an engine whose EngineConfig.warmup is None: "background" (serve
    after the buckets a first request needs), unless ``use_default_mode`` chose another."""
    return _default_mode


def use_default_mode(mode: str) -> None:
    """This process's default warm-up (tests: "full", so no test meets a background
    compile it did not ask for)."""
    global _default_mode
    if mode not in ("full", "background", "lazy"):
        raise ValueError(f"warmup: must be 'full', 'background' or 'lazy', got {mode!r}")
    _default_mode = mode


def priority_order(ladders: BucketLadders) -> tuple[list[Bucket], list[Bucket]]:
    """(first, rest): ``first`` is what a lone first request needs — the smallest decode
    bucket and the smallest prefill bucket without decode slots that holds 128 positions
    (the largest where none does), so a typical chat prompt prefills in one step; both
    share the sampler. ``rest``: every other bucket, cheapest first (small batches come
    before large ones as traffic grows)."""
    every = ladders.all_buckets()
    decode = [b for b in every if b.num_prefill == 0]
    prefill = [b for b in every if b.num_decode == 0 and b.num_prefill > 0 and not b.score]
    first = [min(decode)] if decode else []
    if prefill:
        big = [b for b in prefill if b.num_tokens >= 128]     # buckets sort by num_tokens first
        first.append(min(big) if big else max(prefill))
    elif every:
        first.append(min(b for b in every if b.num_prefill > 0))
    first = sorted(set(first))
    # scoring twins (prompt logprobs) last: most traffic never needs them
    return first, sorted((b for b in every if b not in first), key=lambda b: (b.score, b))


class BucketCompiler:
    """Compiles the ladder's buckets on each runner (one per data-parallel replica), and
    ``extra`` (runner, buckets) pairs after them (a draft model's runner,
    engine/spec_draft.py: the subset of the ladder its steps use)."""

    def __init__(self, runners: list[Any], ladders: BucketLadders,
                 extra: Sequence[tuple[Any, Sequence[Bucket]]] = ()):
        first, rest = priority_order(ladders)
        # (runner, buckets a first request needs, the others)
        self.jobs = [(r, first, rest) for r in runners] + [(r, [], list(bs)) for r, bs in extra]
        self.first_total = sum(len(f) for _, f, _ in self.jobs)
        self.total = sum(len(f) + len(r) for _, f, r in self.jobs)
        self.seconds = 0.0
        self.error: BaseException | None = None
        # called with (buckets compiled, total) after each compile (a progress bar)
        self.progress: Callable[[int, int], None] | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def num_compiled(self) -> int:
        return sum(r.is_compiled(b) for r, first, rest in self.jobs for b in first + rest)

    @property
    def is_warm(self) -> bool:
        return self._done.is_set()

    def status(self) -> dict[str, Any]:
        return {"warm": self.is_warm, "buckets_compiled": self.num_compiled, "buckets_total": self.total}

    def _compile(self, runner: Any, b: Bucket) -> None:
        with self._lock:
            if runner.is_compiled(b):
                return
            t0 = time.perf_counter()
            runner.compile_bucket(b)
            # the compiler's freed scratch back to the system (memory.trim_heap: why); and
            # while the engine serves, the compiler's code pages too, after each bucket
            # (memory.release_code_pages: why; ~20-30 ms, so not after each of a blocking
            # warm-up's buckets: once at its end)
            trim_heap()
            if self._thread is not None:
                release_code_pages()
            self.seconds += time.perf_counter() - t0
        if self.progress is not None:
            self.progress(self.num_compiled, self.total)

    def compile_first(self) -> None:
        """The buckets a first request needs, now (in the caller's thread)."""
        for r, first, _ in self.jobs:
            for b in first:
                self._compile(r, b)
        release_code_pages()

    def compile_rest(self) -> None:
        """Every other bucket, in the caller's thread; then the engine is warm."""
        try:
            for r, _, rest in self.jobs:
                for b in rest:
                    if self._stop:
                        return
                    self._compile(r, b)
        except BaseException as e:   # noqa: BLE001 - reported by ensure() and the log
            self.error = e
            log.exception("compiling buckets failed")
            return
        release_code_pages()
        self._done.set()
        log.info("warm: %d buckets compiled in %.1fs", self.total, self.seconds)

    def start(self) -> None:
        """``compile_rest`` in a daemon thread (the caller serves meanwhile)."""
        self._thread = threading.Thread(target=self.compile_rest, name="jaxinfer-compile", daemon=True)
        self._thread.start()
        # A daemon thread still compiling when the interpreter exits is cut off inside XLA
        # while the runtime is torn down ("terminate called ...", an abort): a script that
        # generated and returned before the engine was warm. Stop it first (after its bucket).
        ref = weakref.ref(self)
        atexit.register(lambda: (c := ref()) is not None and c.stop())

    def ensure(self, runner: Any, b: Bucket) -> None:
        """Called by a step about to run in ``b``: compile it now if it is not there yet
        (after the background thread's current bucket, which holds the lock)."""
        if not runner.is_compiled(b):
            self._compile(runner, b)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every bucket is compiled (or ``timeout`` seconds); True if warm.
        Raises the background thread's error, if it died."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.wait(0.1):
            if self.error is not None:
                raise RuntimeError(f"background compilation failed: {self.error!r}") from self.error
            if self._thread is None or not self._thread.is_alive():
                return self.is_warm
            if deadline is not None and time.monotonic() >= deadline:
                return False
        return True

    def stop(self) -> None:
        """Stop after the bucket being compiled (engine shutdown, interpreter exit)."""
        self._stop = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

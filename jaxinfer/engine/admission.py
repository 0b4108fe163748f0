"""Admission control: refuse a request at once, before it is queued, when it would wait too
long for its first token (EngineConfig.max_queue_delay_ms). Host only: no jax.

``AsyncEngine`` owns one ``Admission``. Its callers consult it on their own thread before
posting a request (``enter``), so a refusal costs no round trip to the engine thread and
the request never takes a place in the scheduler's queue nor a KV page; nothing already
accepted is touched. The ledger holds every request posted whose first output has not
reached its caller yet (waiting, or prefilling): ``leave`` takes it out then, or when the
caller goes away.

The prediction: the prompt tokens queued ahead of the request (those of the ledger's
requests that run before it: every one under "fcfs", those of the same or a more urgent
priority under "priority") plus its own, over the measured prefill rate. The rate is an
EWMA over the engine's real steps (``observe``, from the engine thread: prompt tokens
computed per second of step time, steps with nothing queued left out), so a step spent
only on decodes while requests wait for a seat pulls it down, as it delays them. Before
the first measurement the bound falls back to a queue length: at most ``max_num_seqs``
requests queued ahead (one full batch). A request with nothing queued ahead of it is
always admitted: a stale rate must not refuse the only request. Preempted sequences'
recompute and prefix-cache hits are not counted (the prediction errs by them).
"""

from __future__ import annotations

import math
import threading
from typing import Any

from jaxinfer.errors import QueueFullError

# Weight of the newest step in the prefill-rate EWMA: about the last ten steps count.
RATE_ALPHA = 0.1


class Admission:
    def __init__(self, max_queue_delay_ms: int | None, max_num_seqs: int, policy: str = "fcfs") -> None:
        self.bound_s = None if max_queue_delay_ms is None else max_queue_delay_ms / 1000.0
        self.max_num_seqs = max_num_seqs
        self.by_priority = policy == "priority"
        self._lock = threading.Lock()       # callers' threads and the engine thread
        self._queued: dict[str, tuple[int, int]] = {}      # request id -> (priority, prompt tokens)
        self._tokens = 0
        self._ewma_tokens = self._ewma_seconds = 0.0
        self.num_rejected = 0

    # ---- callers' side ---------------------------------------------------------------
    def enter(self, request_id: str, priority: int, num_tokens: int) -> None:
        """Note a request about to be posted, or raise QueueFullError (reason
        "queue_delay", ``retry_after_s`` set) when its predicted wait exceeds the bound."""
        with self._lock:
            if self.bound_s is not None:
                self._check(priority, num_tokens)
            self._queued[request_id] = (priority if self.by_priority else 0, num_tokens)
            self._tokens += num_tokens

    def leave(self, request_id: str) -> None:
        """The request's first output reached its caller, or the caller left (idempotent)."""
        with self._lock:
            entry = self._queued.pop(request_id, None)
            if entry is not None:
                self._tokens -= entry[1]

    def _check(self, priority: int, num_tokens: int) -> None:
        p = priority if self.by_priority else 0
        ahead = [n for q, n in self._queued.values() if q <= p] if self.by_priority else None
        num_ahead = len(self._queued) if ahead is None else len(ahead)
        if num_ahead == 0:
            return
        rate = self._rate()
        if rate is None:
            if num_ahead < self.max_num_seqs:
                return
            self.num_rejected += 1
            raise QueueFullError(f"{num_ahead} requests are queued ahead of this one (at most "
                                 f"{self.max_num_seqs} before the engine has measured its prefill rate)",
                                 reason="queue_delay", retry_after_s=1)
        tokens = (self._tokens if ahead is None else sum(ahead)) + num_tokens
        delay = tokens / rate
        if delay <= self.bound_s:
            return
        self.num_rejected += 1
        raise QueueFullError(f"the predicted wait for a first token is {delay * 1000:.0f} ms "
                             f"({tokens} prompt tokens at {rate:.0f} tokens/s), over the "
                             f"{self.bound_s * 1000:.0f} ms bound", reason="queue_delay",
                             retry_after_s=max(1, math.ceil(delay - self.bound_s)))

    # ---- engine thread ---------------------------------------------------------------
    def busy(self) -> bool:
        """Something is queued: the next step's throughput tells how fast the queue drains."""
        return bool(self._queued)

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        """One engine step that ran while requests were queued: ``prompt_tokens`` computed in
        ``seconds`` of wall time."""
        if seconds <= 0:
            return
        with self._lock:
            if self._ewma_seconds == 0.0:
                if not prompt_tokens:     # the overlapped loop's first call resolves nothing
                    return
                self._ewma_tokens, self._ewma_seconds = float(prompt_tokens), seconds
            else:
                self._ewma_tokens += RATE_ALPHA * (prompt_tokens - self._ewma_tokens)
                self._ewma_seconds += RATE_ALPHA * (seconds - self._ewma_seconds)

    def _rate(self) -> float | None:
        """Prompt tokens per second (an EWMA of tokens over an EWMA of seconds, so a short
        step does not swing it), or None before the first measurement."""
        if self._ewma_seconds == 0.0:
            return None
        return max(self._ewma_tokens / self._ewma_seconds, 1e-9)

    def stats(self) -> dict[str, Any]:
        """For /metrics: the rate, the queued prompt tokens and the wait they predict for a
        request behind all of them (0 before the first measurement)."""
        with self._lock:
            rate = self._rate()
            return {"prefill_tokens_per_s": rate or 0.0,
                    "queued_prompt_tokens": self._tokens,
                    "predicted_queue_delay_s": self._tokens / rate if rate else 0.0,
                    "num_rejected_queue_delay_total": self.num_rejected}

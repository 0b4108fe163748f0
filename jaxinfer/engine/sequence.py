"""One sample of one request, as the scheduler and block manager see it.

Host only: plain Python, no jax. A request with ``params.n == k`` becomes ``k``
``Sequence`` objects that share ``request_id`` and the prompt and differ in
``sample_index`` (0..k-1); see ``make_sequences``.

Token model (vLLM v1 style, no prefill/decode distinction): a sequence is its prompt
plus the tokens sampled so far. ``num_computed_tokens`` of them have their KV in the
cache; the next step must compute ``num_new_tokens_needed`` more (the whole prompt at
first, then 1 per decode step, or prompt+outputs again after a preemption).

The overlapped step loop (engine.py) schedules step N+1 before step N's tokens reach the
host: ``num_pending`` counts tokens sampled on the device and not yet appended. They are
part of ``num_tokens`` (the scheduler's view: a pending token is the next one to feed,
and the device feeds it itself) but not of ``output_token_ids`` nor of
``num_known_tokens`` (what the host can read, stop checks and outputs).
"""

from __future__ import annotations

import enum
import itertools
import secrets
import time
from dataclasses import dataclass, field

from jaxinfer.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"        # never admitted yet
    RUNNING = "running"        # holds pages, gets scheduled
    PREEMPTED = "preempted"    # was running, pages freed, back in the waiting queue
    FINISHED = "finished"      # stopped, length, or aborted; holds no pages


_seq_ids = itertools.count()


def next_seq_id() -> int:
    """A process-wide unique sequence id (``itertools.count`` is atomic under the GIL)."""
    return next(_seq_ids)


# Sequences compare by identity (eq=False): two samples with equal tokens are still two.
@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sample_index: int = 0
    priority: int = 0                          # lower runs first; FCFS within a priority
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0               # tokens whose KV is in the cache
    page_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None           # "stop" | "length" | "abort"
    stop_reason: str | int | None = None       # the stop string / token id that ended it
    num_preemptions: int = 0
    # Tokens found in the KV cache at the last admission (shared from a sibling or a
    # prefix-cache hit), for stats: they were not recomputed.
    num_cached_tokens: int = 0
    # Chain hashes of this sequence's full pages (block manager, prefix caching). Tokens
    # are append-only, so a full page's hash never changes, even across preemptions.
    page_hashes: list[int] = field(default_factory=list)
    # Sum of the sampled tokens' logprobs, where the sampler computed them (best_of ranks
    # samples by it).
    cumulative_logprob: float = 0.0
    # The LoRA adapter this sequence runs with (engine/lora.py LoraAdapter.lora_id, unique
    # per load), 0 = the base model. Part of its prefix-cache hash chain.
    lora_id: int = 0
    # Output tokens the device's penalty state does not count yet: accepted draft tokens
    # (fed as drafts, uncounted), folded in at the sequence's next step. Only with
    # penalties (engine/speculative.py).
    uncounted_tokens: list[int] = field(default_factory=list)
    # Tokens sampled by a step in flight, not yet appended (Scheduler.commit / resolve).
    num_pending: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + outputs + pending: the tokens the scheduler plans with."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Prompt + outputs on the host (``num_tokens`` less the pending ones)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + outputs (a new list; use ``token_ids_slice`` for a window)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_new_tokens_needed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list (known tokens
        only: a pending position is not there)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def __repr__(self) -> str:  # the default would print every token
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}#{self.sample_index}, "
                f"{self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"pages={len(self.page_ids)})")


def derive_seed(seed: int | None, index: int) -> int:
    """The sampler seed of sample ``index`` of a request: reproducible for a given request
    seed, fresh randomness when the request gave none. Shared by the engine and the
    reference generator, so a seeded request samples the same tokens in both."""
    if seed is None:
        return secrets.randbits(32)
    return (seed * 0x9E3779B1 + index * 0x85EBCA77) & 0xFFFFFFFF


def make_sequences(request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                   priority: int = 0, arrival_time: float | None = None, lora_id: int = 0) -> list[Sequence]:
    """The sequences of one request (prompt list shared read-only): ``params.n`` samples,
    ``best_of`` when it asks for more, one for a beam search (it forks the others)."""
    t = time.monotonic() if arrival_time is None else arrival_time
    prompt = list(prompt_token_ids)
    count = 1 if params.beam_width > 1 else (params.best_of or params.n)
    return [Sequence(seq_id=next_seq_id(), request_id=request_id, prompt_token_ids=prompt,
                     params=params, sample_index=i, priority=priority, arrival_time=t,
                     lora_id=lora_id)
            for i in range(count)]

"""What the engine gives back for a request: a ``RequestOutput`` per prompt holding one
``CompletionOutput`` per sample, their ``Logprob`` entries and the request's
``RequestMetrics`` times. Plain records, filled in by the engine as the request runs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Logprob:
    """One sampled position: the chosen token's log-probability and the top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token id, logprob), most likely first


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` samples of a request (cumulative so far)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None          # "stop" | "length" | "abort" | None (running)
    stop_reason: str | int | None = None      # the stop string or token id that ended it
    logprobs: list[Logprob] | None = None
    # Sum of the chosen tokens' logprobs (best_of and beam search; else None). Beam
    # search also reports HF's sequence score: cumulative_logprob / length ** length_penalty.
    cumulative_logprob: float | None = None
    beam_score: float | None = None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.monotonic()) of a request's life, for serving metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """What ``Engine.generate`` returns per prompt, and ``AsyncEngine`` yields as it grows."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (it
    # has no context); filled once the prompt is computed.
    prompt_logprobs: list[Logprob | None] | None = None

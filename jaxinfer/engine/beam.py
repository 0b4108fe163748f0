"""Beam search (``SamplingParams.beam_width``), as HF transformers ``generate(num_beams=W,
do_sample=False)`` does it, on the continuous-batching engine.

Host only: plain Python and numpy, no jax. Each live beam is an ordinary ``Sequence``
that decodes one token per step, batched with every other request. The device does
nothing special: a beam's row asks the sampler for its top ``MAX_LOGPROBS`` raw
log-probabilities, and the search runs here on those. Each beam contributes at most
``keep = max(2, 1 + number of stop tokens) * W`` candidates to the global top ``keep``,
all within its own top ``keep``, so 20 per beam serve any width up to
``SamplingParams.MAX_BEAM_WIDTH`` (the engine refuses a width whose ``keep`` exceeds 20).

One search step, once every live beam reported its candidates (HF 5.x ``_beam_search``):

1. Candidates ``(beam score + logprob, beam, token)`` from all beams; the best ``keep``
   (ties: lower beam, then lower token id first).
2. A candidate *hits* when its token is a stop token or it reaches the length limit.
3. The next beams are the best ``W`` candidates that do not hit.
4. Among the first ``W`` candidates, those that hit become finished hypotheses scored
   ``cumulative logprob / generated_length ** length_penalty`` (the stop token counts),
   unless W are finished already with ``early_stopping=True``, or the search has
   concluded no running beam can improve; the best ``W`` hypotheses are kept.
5. It ends when W hypotheses are finished and either ``early_stopping`` is True or the
   best running beam, scored at its current length (``"never"`` with a positive length
   penalty: at the length limit), is no better than the worst of them; or when every
   candidate hits.

The returned sequences are the best ``n`` hypotheses.

The engine side (``BeamRequest.advance``): a beam with several children keeps its
sequence for the first and forks the others (``Scheduler.fork``: full pages shared,
the partial last page copied on the device); beams without children are finished and
their pages freed. A beam's step appends no token by itself (the scheduler gets
``None``): the search appends once all beams have reported, so a beam that reported
waits, unscheduled, for the others (one preempted and recomputing, say).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.engine.sequence import Sequence, next_seq_id


@dataclass(frozen=True, slots=True)
class Hypothesis:
    """A finished beam: its generated tokens (the stop token included, if it ended on one)."""

    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float                 # cumulative_logprob / len(token_ids) ** length_penalty
    stop_token: int | None       # the stop token it ended on; None: length limit


@dataclass(frozen=True, slots=True)
class Candidate:
    score: float                 # the beam's cumulative logprob + this token's
    beam: int                    # index into the live beams
    token: int


def candidates_to_keep(width: int, num_stop_tokens: int) -> int:
    """HF's ``beams_to_keep``: enough that W candidates remain when the best ones stop."""
    return max(2, 1 + num_stop_tokens) * width


def check_width(params: SamplingParams, num_stop_tokens: int) -> None:
    """ValueError if the sampler's top-MAX_LOGPROBS cannot hold the candidates a beam
    must offer (a width with many stop tokens)."""
    keep = candidates_to_keep(params.beam_width, num_stop_tokens)
    if keep > SamplingParams.MAX_LOGPROBS:
        raise ValueError(f"beam_width: {params.beam_width} beams with {num_stop_tokens} stop tokens need "
                         f"{keep} candidates per beam, more than the {SamplingParams.MAX_LOGPROBS} served")


def top_candidates(scores: list[float], tops: list[tuple[np.ndarray, np.ndarray]], keep: int) -> list[Candidate]:
    """The best ``keep`` continuations of beams with cumulative ``scores``, from each
    beam's top (token ids, logprobs); in score order, ties by beam then token id."""
    cands = [Candidate(float(s + lp), b, int(t)) for b, (s, (ids, lps)) in enumerate(zip(scores, tops))
             for t, lp in zip(ids[:keep], lps[:keep])]
    cands.sort(key=lambda c: (-c.score, c.beam, c.token))
    return cands[:keep]


@dataclass
class BeamState:
    """One request's search, on token ids only (what the engine sees is BeamRequest)."""

    width: int
    length_penalty: float
    early_stopping: bool | str
    stop_ids: frozenset[int]
    max_new_tokens: int
    scores: list[float] = field(default_factory=lambda: [0.0])      # live beams' cumulative logprobs
    finished: list[Hypothesis] = field(default_factory=list)        # best first, at most width
    num_generated: int = 0
    improvable: bool = True      # HF's is_early_stop_heuristic_unsatisfied
    done: bool = False

    @property
    def keep(self) -> int:
        return candidates_to_keep(self.width, len(self.stop_ids))

    def step(self, outputs: list[tuple[int, ...]], tops: list[tuple[np.ndarray, np.ndarray]]) -> list[Candidate]:
        """One step from the live beams' generated tokens and top candidates -> the next
        live beams (``Candidate.beam`` = parent index); updates hypotheses and ``done``."""
        cands = top_candidates(self.scores, tops, self.keep)
        n = self.num_generated + 1
        hits = [c.token in self.stop_ids or n >= self.max_new_tokens for c in cands]
        running = [c for c, h in zip(cands, hits) if not h][:self.width]
        full = len(self.finished) == self.width
        if self.improvable and not (full and self.early_stopping is True):
            new = [Hypothesis(outputs[c.beam] + (c.token,), c.score, c.score / n ** self.length_penalty,
                              c.token if c.token in self.stop_ids else None)
                   for c, h in zip(cands[:self.width], hits) if h]
            self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:self.width]
        self.num_generated = n
        self.scores = [c.score for c in running]
        self._update_done(all(hits), running)
        return running

    def _update_done(self, all_hit: bool, running: list[Candidate]) -> None:
        if len(self.finished) == self.width and running:
            never = self.early_stopping == "never" and self.length_penalty > 0
            length = self.max_new_tokens if never else self.num_generated
            best = running[0].score / length ** self.length_penalty
            self.improvable = self.improvable and best > self.finished[-1].score
        closed = len(self.finished) == self.width and self.early_stopping is True
        self.done = all_hit or not running or not self.improvable or closed


class BeamRequest:
    """The engine's handle on one request's search: its live beams as sequences.

    ``finish(seq)`` is the engine's way to end a dropped beam (frees its pages and
    penalty row); ``fork(parent, child)`` is ``Scheduler.fork``.
    """

    def __init__(self, root: Sequence, stop_ids: Iterable[int], max_new_tokens: int) -> None:
        p = root.params
        self.state = BeamState(p.beam_width, p.length_penalty, p.early_stopping, frozenset(stop_ids),
                               max_new_tokens)
        self.beams: list[Sequence] = [root]
        self._tops: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def done(self) -> bool:
        return self.state.done

    def report(self, seq: Sequence, top_ids: np.ndarray, top_logprobs: np.ndarray) -> bool:
        """A beam's candidates from this step; True once every live beam has reported."""
        self._tops[seq.seq_id] = (np.asarray(top_ids), np.asarray(top_logprobs))
        return all(b.seq_id in self._tops for b in self.beams)

    def advance(self, fork: Callable[[Sequence, Sequence], None], finish: Callable[[Sequence], None]) -> None:
        """Run the search step and re-shape the beams: forks first (they copy their
        parent's KV before anything else happens to it), then the drops."""
        tops = [self._tops[b.seq_id] for b in self.beams]
        self._tops.clear()
        outputs = [tuple(b.output_token_ids) for b in self.beams]
        running = self.state.step(outputs, tops)
        taken: set[int] = set()
        new: list[Sequence] = []
        for c in running:
            parent = self.beams[c.beam]
            if c.beam in taken:
                child = Sequence(next_seq_id(), parent.request_id, parent.prompt_token_ids, parent.params,
                                 priority=parent.priority, arrival_time=parent.arrival_time,
                                 output_token_ids=list(outputs[c.beam]) + [c.token])
                fork(parent, child)
                new.append(child)
            else:
                taken.add(c.beam)
                new.append(parent)
        for i in sorted(taken):
            self.beams[i].append_token(next(c.token for c in running if c.beam == i))
        for i, b in enumerate(self.beams):
            if i not in taken:
                finish(b)
        self.beams = new
        if self.state.done:
            for b in self.beams:
                finish(b)
            self.beams = []

    def results(self, n: int) -> list[Hypothesis]:
        """The best ``n`` hypotheses (once done)."""
        return self.state.finished[:n]

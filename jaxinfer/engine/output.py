"""A step's sampled tokens -> request state: append, logprobs, grammar state, stop
conditions, finish; and the outputs handed to callers (cumulative snapshots or deltas).

Host only (no jax). One token at a time: speculative decoding and multi-step decode feed
their runs through ``OutputProcessor.apply`` position by position, exactly as that many
single steps would, so a stop inside a run ends the sequence there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from jaxinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.engine import search
from jaxinfer.engine.detokenizer import IncrementalDetokenizer
from jaxinfer.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from jaxinfer.engine.sequence import Sequence

log = logging.getLogger("jaxinfer")


@dataclass
class RequestState:
    """One request inside the engine: its sequences (one per sample), their detokenizers,
    sampler seeds, logprobs so far and grammar state."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    seeds: list[int]
    logprobs: list[list[Logprob]] | None
    metrics: RequestMetrics
    replica: int = 0                    # data-parallel replica running it
    constraints: list[Any] | None = None   # guided.SequenceConstraints per sample, if constrained
    finished: bool = False
    sent: list[tuple[int, int]] = field(default_factory=list)   # per sample: tokens, chars in deltas so far
    beam: Any = None                    # beam.BeamRequest of a beam search (engine/search.py)
    prompt_logprobs: list[Logprob | None] | None = None        # SamplingParams.prompt_logprobs
    final: list[CompletionOutput] | None = None    # a finished beam / best_of request's outputs

    @property
    def visible(self) -> bool:
        """Its outputs may be shown: beam and best_of requests show only their final ones."""
        return self.finished or search.streams(self.params)

    def _output(self, outs: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished,
                             self.metrics, self.prompt_logprobs)

    def delta(self) -> RequestOutput:
        """What is new since this request's previous ``delta()``: per sample, the new token ids,
        text and logprobs. Costs O(new), where ``snapshot`` copies everything so far."""
        if self.final is not None:
            return self._output(self.final)
        if not self.sent:
            self.sent = [(0, 0)] * len(self.seqs)
        outs = []
        for i, (seq, d) in enumerate(zip(self.seqs, self.detoks)):
            nt, nc = self.sent[i]
            toks = seq.output_token_ids
            outs.append(CompletionOutput(
                index=i, text=d.text_since(nc), token_ids=toks[nt:], finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason, logprobs=None if self.logprobs is None else self.logprobs[i][nt:]))
            self.sent[i] = (len(toks), d.text_len)
        return self._output(outs)

    def snapshot(self) -> RequestOutput:
        if self.final is not None:
            return self._output(self.final)
        outs = []
        for i, (seq, d) in enumerate(zip(self.seqs, self.detoks)):
            outs.append(CompletionOutput(
                index=i, text=d.text, token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                logprobs=None if self.logprobs is None else list(self.logprobs[i])))
        return self._output(outs)


class OutputProcessor:
    """Owns the engine's live requests and what happens to a sampled token.

    ``finish_seq(seq, reason, stop_reason)`` is the engine's: it frees the sequence's pages
    and penalty-state row on the replica that runs it."""

    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int,
                 finish_seq: Callable[[Sequence, str, Any], None], tokenizer: Any = None):
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer          # beam search detokenizes its hypotheses at the end
        self.max_model_len = max_model_len
        self.finish_seq = finish_seq
        self.requests: dict[str, RequestState] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def apply(self, scheduler: Scheduler, sched: SchedulerOutput, entries: list[tuple[int, ScheduledSeq]],
              res: Any, committed: bool = False) -> list[RequestState]:
        """One step's sampled tokens (``res``: sampler.Unpacked, indexed by slot) -> the
        requests that changed; finished ones are dropped from ``requests``. ``committed``:
        the scheduler committed the step when it was dispatched (Scheduler.commit)."""
        # beams and scoring-only sequences get no token from the scheduler (engine/search.py)
        sampled = {e.seq.seq_id: None if search.holds(e.seq) else int(res.token_ids[slot])
                   for slot, e in entries if e.samples}
        slot_of = {e.seq.seq_id: slot for slot, e in entries}
        grew = scheduler.resolve(sched, sampled) if committed else scheduler.postprocess(sched, sampled)
        self.prompt_tokens_total += sum(e.num_new_tokens for e in sched.scheduled
                                        if e.start_pos < e.seq.num_prompt_tokens)
        now = time.monotonic()
        touched = self._held(scheduler, entries, sampled, res)
        for seq in grew:
            req = self.requests.get(seq.request_id)
            if req is None:
                continue
            touched[req.request_id] = req
            self.generation_tokens_total += 1
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            tok = seq.output_token_ids[-1]
            search.add_chosen_logprob(seq, res, slot_of[seq.seq_id])
            if req.logprobs is not None:
                req.logprobs[seq.sample_index].append(_logprob(res, slot_of[seq.seq_id], tok, seq.params.logprobs))
            self._advance(req, seq, tok)
        for req in touched.values():
            if all(s.is_finished for s in req.seqs):
                req.finished = True
                req.metrics.finished_time = now
                req.final = search.final_outputs(req, self.tokenizer)
                del self.requests[req.request_id]
        return list(touched.values())

    def _held(self, scheduler: Scheduler, entries: list[tuple[int, ScheduledSeq]], sampled: dict,
              res: Any) -> dict[str, RequestState]:
        """The sequences whose token the scheduler held back: a beam's search step, a
        scoring-only request's end (search.after_step) -> the requests that changed."""
        touched: dict[str, RequestState] = {}
        for slot, e in entries:
            req = self.requests.get(e.seq.request_id)
            if req is None or sampled.get(e.seq.seq_id, 0) is not None or e.seq.is_finished:
                continue
            if search.after_step(req.beam, e.seq, slot, res, scheduler.fork,
                                 lambda s, why: self.finish_seq(s, why, None)):
                touched[req.request_id] = req
            if req.beam is not None:
                req.seqs = req.beam.beams
        return touched

    def _advance(self, req: RequestState, seq: Sequence, tok: int) -> None:
        c = req.constraints[seq.sample_index] if req.constraints else None
        if c is not None:
            c.advance(tok)
        self._check_stop(req, seq, tok)
        if c is not None and c.stopped and not seq.is_finished:
            # the grammar is complete (or refused the token: logged) and only EOS could follow
            if c.error:
                log.warning("request %s: grammar stopped: %s", req.request_id, c.error)
            req.detoks[seq.sample_index].finish()
            self.finish_seq(seq, "stop", None)

    def _check_stop(self, req: RequestState, seq: Sequence, tok: int) -> None:
        p = seq.params
        d = req.detoks[seq.sample_index]
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            d.finish()
            return self.finish_seq(seq, "stop", tok)
        d.append(tok)
        if d.stopped_by is not None:
            return self.finish_seq(seq, "stop", d.stopped_by)
        if seq.num_output_tokens >= p.max_tokens or seq.num_known_tokens >= self.max_model_len:
            d.finish()
            self.finish_seq(seq, "length", None)


def _logprob(res: Any, slot: int, tok: int, k: int | None) -> Logprob:
    k = k or 0
    return Logprob(tok, float(res.logprobs[slot]), tuple(
        (int(i), float(x)) for i, x in zip(res.top_ids[slot, :k], res.top_logprobs[slot, :k])))


def replay_runs(apply: Callable[[SchedulerOutput, list[tuple[int, ScheduledSeq]], int], list[Any]],
                first: tuple[SchedulerOutput, list[tuple[int, ScheduledSeq]]],
                runs: list[tuple[int, Sequence, int, int]]) -> list[Any]:
    """Feed token runs through the one-token postprocessing: ``first`` is the step as
    scheduled (each entry's first token); ``runs`` (slot, seq, tokens in the run, slot
    stride) gives position i of a run at slot ``slot + i * stride`` of result ``i``
    (``apply(sched, entries, i)``). A sequence that finished stops consuming its run.
    Returns the requests touched, each once, finished ones last."""
    touched = {id(r): r for r in apply(*first, 0)}
    for i in range(1, max((n for _, _, n, _ in runs), default=0)):
        live = [(slot + i * stride, ScheduledSeq(seq, seq.num_computed_tokens, 1, True))
                for slot, seq, n, stride in runs if n > i and not seq.is_finished]
        if not live:
            break
        for r in apply(SchedulerOutput([e for _, e in live], [], len(live)), live, i):
            touched.pop(id(r), None)
            touched[id(r)] = r
    return sorted(touched.values(), key=lambda r: r.finished)

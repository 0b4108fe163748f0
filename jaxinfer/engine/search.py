"""The engine's side of requests whose outputs are not one sampled stream per sample:
beam search (engine/beam.py), ``best_of`` (``best_of`` samples, the ``n`` with the highest
cumulative logprob returned) and scoring-only requests (``max_tokens=0``: the prompt's
logprobs, nothing generated); and where prompt logprobs are kept.

Host only (no jax). One hook into post-processing: ``holds(seq)`` says, before the
scheduler appends a step's sampled tokens, which sequences must not get theirs (a beam
appends when its search step runs; a scoring-only sequence appends nothing), and
``after_step`` handles those sequences once the scheduler is done. ``outputs`` builds
the final outputs of beam and best_of requests, which show nothing until they finish
(their samples are not the answer until then).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from jaxinfer.outputs import CompletionOutput, Logprob
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.engine.beam import BeamRequest, check_width
from jaxinfer.engine.detokenizer import IncrementalDetokenizer
from jaxinfer.engine.sequence import Sequence


def streams(p: SamplingParams) -> bool:
    """Whether outputs may be shown before the request finishes."""
    return p.beam_width == 1 and (p.best_of or p.n) == p.n


def wants_chosen_logprob(p: SamplingParams) -> bool:
    """best_of ranks samples by cumulative logprob: the sampler must compute it."""
    return p.best_of is not None and p.best_of > p.n


def stop_ids(p: SamplingParams, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
    return frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(eos_token_ids))


def start(p: SamplingParams, seqs: list[Sequence], eos_token_ids: tuple[int, ...],
          max_model_len: int) -> BeamRequest | None:
    """At add_request: the request's beam search, if it is one (ValueError for a width
    the sampler's top-k cannot serve), and an empty prompt-logprob list if asked for."""
    if p.beam_width == 1:
        return None
    stops = stop_ids(p, eos_token_ids)
    check_width(p, len(stops))
    root = seqs[0]
    return BeamRequest(root, stops, min(p.max_tokens, max_model_len - root.num_prompt_tokens))


def prompt_logprob_list(p: SamplingParams, num_prompt_tokens: int) -> list[Logprob | None] | None:
    """One entry per prompt token (the first stays None: nothing predicts it)."""
    return None if p.prompt_logprobs is None else [None] * num_prompt_tokens


def holds(seq: Sequence) -> bool:
    """The scheduler must not append this sequence's sampled token."""
    return seq.params.beam_width > 1 or seq.params.max_tokens == 0


def after_step(beam: BeamRequest | None, seq: Sequence, slot: int, res: Any,
               fork: Callable[[Sequence, Sequence], None], finish: Callable[[Sequence, str], None]) -> bool:
    """A held sequence after the scheduler's postprocess -> whether its request's state
    changed. ``fork`` is Scheduler.fork; ``finish(seq, reason)`` frees a sequence."""
    if seq.params.max_tokens == 0:
        finish(seq, "length")               # the prompt is scored: nothing to generate
        return True
    if beam.report(seq, res.top_ids[slot], res.top_logprobs[slot]):
        beam.advance(fork, lambda s: finish(s, "pruned"))
        return beam.done
    return False


def beam_outputs(beam: BeamRequest, p: SamplingParams, tokenizer: Any,
                 prompt_token_ids: list[int]) -> list[CompletionOutput]:
    """The best ``n`` hypotheses as outputs: text without the stop token they ended on
    (as a sampled sequence's), token ids with it."""
    outs = []
    for i, h in enumerate(beam.results(p.n)):
        d = IncrementalDetokenizer(tokenizer, prompt_token_ids, p.skip_special_tokens)
        for t in h.token_ids[:-1] if h.stop_token is not None else h.token_ids:
            d.append(t)
        d.finish()
        outs.append(CompletionOutput(i, d.text, list(h.token_ids), "stop" if h.stop_token is not None else "length",
                                     h.stop_token, None, h.cumulative_logprob, h.score))
    return outs


def final_outputs(req: Any, tokenizer: Any) -> list[CompletionOutput] | None:
    """A finished request's outputs when they are not its samples as they ran (a beam
    search's hypotheses, the best n of best_of samples), else None."""
    p = req.params
    if req.beam is not None:
        return beam_outputs(req.beam, p, tokenizer, req.prompt_token_ids)
    if streams(p):
        return None
    outs = []
    for i, j in enumerate(best_of_order(req.seqs, p.n)):
        s, d = req.seqs[j], req.detoks[j]
        outs.append(CompletionOutput(i, d.text, list(s.output_token_ids), s.finish_reason, s.stop_reason,
                                     None if req.logprobs is None else list(req.logprobs[j]), s.cumulative_logprob))
    return outs


def best_of_order(seqs: list[Sequence], n: int) -> list[int]:
    """Indices of the ``n`` samples with the highest cumulative logprob (ties: lower index)."""
    return sorted(range(len(seqs)), key=lambda i: (-seqs[i].cumulative_logprob, i))[:n]


def add_chosen_logprob(seq: Sequence, res: Any, slot: int) -> None:
    """Cumulative logprob of a sample (best_of, and reported with every output)."""
    seq.cumulative_logprob += float(np.float32(res.logprobs[slot]))

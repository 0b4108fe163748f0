"""Response shapes for scoring and search: the echoed prompt's logprobs (OpenAI
completions), vLLM's ``prompt_logprobs``, TGI's ``details.prefill``, and a choice's
cumulative logprob / beam score (best_of, beam search)."""

from __future__ import annotations

from typing import Any, Sequence

from jaxinfer.outputs import Logprob, RequestOutput
from serving.token_texts import finite



def echo_logprobs(out: RequestOutput, k: int, texts: Any) -> tuple[dict, int]:
    """OpenAI completions ``logprobs`` of the echoed prompt (the first token has none:
    null, as OpenAI and vLLM answer); returns it and the text offset after it."""
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for tid, lp in zip(out.prompt_token_ids, _prompt_entries(out)):
        t = texts(tid)
        tokens.append(t)
        offsets.append(offset)
        offset += len(t)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(finite(lp.logprob))
        top = {texts(i): finite(v) for i, v in lp.top[:k]}
        top.setdefault(t, finite(lp.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def join_logprobs(a: dict, b: dict | None) -> dict:
    """Two completions ``logprobs`` objects, one after the other."""
    return a if b is None else {k: a[k] + b[k] for k in a}


def vllm_prompt_logprobs(out: RequestOutput, texts: Any) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id:
    {"logprob", "rank", "decoded_token"}} for the token and its top alternatives (rank
    1-based among the alternatives; null for a token outside them)."""
    res: list[dict | None] = []
    for tid, lp in zip(out.prompt_token_ids, _prompt_entries(out)):
        if lp is None:
            res.append(None)
            continue
        d = {str(i): {"logprob": finite(v), "rank": r + 1, "decoded_token": texts(i)}
             for r, (i, v) in enumerate(lp.top)}
        rank = next((r + 1 for r, (i, _) in enumerate(lp.top) if i == tid), None)
        d.setdefault(str(tid), {"logprob": finite(lp.logprob), "rank": rank, "decoded_token": texts(tid)})
        res.append(d)
    return res


def tgi_prefill(out: RequestOutput, texts: Any) -> list[dict]:
    """TGI ``details.prefill``: the prompt tokens with their logprobs (null for the first)."""
    return [{"id": tid, "text": texts(tid), "logprob": None if lp is None else finite(lp.logprob)}
            for tid, lp in zip(out.prompt_token_ids, _prompt_entries(out))]


def search_fields(o: Any) -> dict[str, float]:
    """A choice's cumulative logprob / beam score, where the engine reports them."""
    return {k: getattr(o, k) for k in ("cumulative_logprob", "beam_score") if getattr(o, k, None) is not None}


def _prompt_entries(out: RequestOutput) -> Sequence[Logprob | None]:
    lps = out.prompt_logprobs
    if lps is None or len(lps) != len(out.prompt_token_ids):
        raise RuntimeError("prompt logprobs were asked for but the engine returned none")
    return lps

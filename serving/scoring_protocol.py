"""Request fields and response shapes for scoring and search: prompt logprobs (OpenAI
``echo`` + ``logprobs``, vLLM's ``prompt_logprobs``, TGI's ``decoder_input_details``),
``best_of``, beam search (vLLM's ``use_beam_search`` with ``length_penalty`` /
``early_stopping``; ``num_beams`` on TGI's parameters) and the watermark (TGI's
``watermark: true``; the same field, or ``{"gamma": g, "delta": d}``, on OpenAI routes).

Each parser returns ``SamplingParams`` keywords (only those that are set); the engine
validates the combinations (config.SamplingParams), and its messages come back as 400 /
422 naming the field.
"""

from __future__ import annotations

from typing import Any, Sequence

from jaxinfer.config import Logprob, RequestOutput, SamplingParams
from serving.protocol import Fields, Limits, _lp, _type_name, bad

_SEARCH_ONLY = ("length_penalty", "early_stopping")


def openai_search(f: Fields, limits: Limits, *, n: int, echo: bool, logprobs: int | None,
                  stream: bool) -> dict[str, Any]:
    """/v1/completions: prompt logprobs, best_of, beam search, watermark."""
    out: dict[str, Any] = {}
    plp = f.int("prompt_logprobs", None, lo=0, hi=SamplingParams.MAX_LOGPROBS)
    if echo and logprobs is not None:          # OpenAI: the echoed prompt carries logprobs too
        plp = max(plp or 0, logprobs)
    if plp is not None:
        out["prompt_logprobs"] = plp
    best_of = f.int("best_of", None, lo=1)
    if best_of is not None and best_of > limits.max_n:
        raise bad("best_of", f"must be <= {limits.max_n} on this server, got {best_of}")
    if f.bool("use_beam_search", False):
        if stream:
            raise bad("use_beam_search", "beam search cannot stream (the beams change until the end)",
                      code="unsupported")
        out.update(beam_width=best_of or n, length_penalty=f.num("length_penalty", 1.0),
                   early_stopping=early_stopping(f))
        if f.get("temperature") is None:
            out["temperature"] = 0.0           # beam search is deterministic (vLLM asks for 0)
    else:
        for key in _SEARCH_ONLY:
            if f.get(key) is not None:
                raise bad(key, "only applies with use_beam_search")
        if best_of is not None:
            if best_of < n:
                raise bad("best_of", f"must be >= n ({n}), got {best_of}")
            if best_of > n and stream:
                raise bad("best_of", "streaming is not supported with best_of > n", code="unsupported")
            if best_of > n:
                out["best_of"] = best_of
    wm = watermark(f)
    if wm is not None:
        out["watermark"] = wm
    return out


def tgi_search(f: Fields, limits: Limits, *, stream: bool, details: bool) -> dict[str, Any]:
    """TGI ``parameters``: watermark, decoder_input_details (prompt logprobs), num_beams."""
    out: dict[str, Any] = {}
    if f.bool("watermark", False):
        out["watermark"] = True
    if f.bool("decoder_input_details", False):
        if stream:
            raise bad(f.name("decoder_input_details"), "is not supported when streaming tokens")
        if details:
            out["prompt_logprobs"] = 0
    beams = f.int("num_beams", None, lo=1, hi=min(limits.max_n, SamplingParams.MAX_BEAM_WIDTH))
    if beams is not None and beams > 1:
        if stream:
            raise bad(f.name("num_beams"), "beam search cannot stream (the beams change until the end)")
        out.update(beam_width=beams, length_penalty=f.num("length_penalty", 1.0),
                   early_stopping=early_stopping(f))
    else:
        for key in _SEARCH_ONLY:
            if f.get(key) is not None:
                raise bad(f.name(key), "only applies with num_beams > 1")
    return out


def early_stopping(f: Fields) -> bool | str:
    v = f.get("early_stopping")
    if v is None:
        return False
    if isinstance(v, bool) or v == "never":
        return v
    raise bad(f.name("early_stopping"), f'must be true, false or "never", got {_type_name(v)}')


def watermark(f: Fields) -> Any:
    """``watermark``: true / false, or an object with ``gamma`` and ``delta``."""
    v = f.get("watermark")
    if v is None or v is False:
        return None
    if v is True:
        return True
    if isinstance(v, dict):
        w = Fields(v, f.name("watermark") + ".")
        unknown = set(v) - {"gamma", "delta"}
        if unknown:
            raise bad(w.name(sorted(unknown)[0]), "unknown field (gamma, delta)")
        return {k: w.num(k) for k in ("gamma", "delta") if v.get(k) is not None}
    raise bad(f.name("watermark"), f"must be a boolean or an object with gamma and delta, got {_type_name(v)}")


# ------------------------------------------------------------------ responses

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
        token_lps.append(_lp(lp.logprob))
        top = {texts(i): _lp(v) for i, v in lp.top[:k]}
        top.setdefault(t, _lp(lp.logprob))
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
        d = {str(i): {"logprob": _lp(v), "rank": r + 1, "decoded_token": texts(i)}
             for r, (i, v) in enumerate(lp.top)}
        rank = next((r + 1 for r, (i, _) in enumerate(lp.top) if i == tid), None)
        d.setdefault(str(tid), {"logprob": _lp(lp.logprob), "rank": rank, "decoded_token": texts(tid)})
        res.append(d)
    return res


def tgi_prefill(out: RequestOutput, texts: Any) -> list[dict]:
    """TGI ``details.prefill``: the prompt tokens with their logprobs (null for the first)."""
    return [{"id": tid, "text": texts(tid), "logprob": None if lp is None else _lp(lp.logprob)}
            for tid, lp in zip(out.prompt_token_ids, _prompt_entries(out))]


def search_fields(o: Any) -> dict[str, float]:
    """A choice's cumulative logprob / beam score, where the engine reports them."""
    return {k: getattr(o, k) for k in ("cumulative_logprob", "beam_score") if getattr(o, k, None) is not None}


def _prompt_entries(out: RequestOutput) -> Sequence[Logprob | None]:
    lps = out.prompt_logprobs
    if lps is None or len(lps) != len(out.prompt_token_ids):
        raise RuntimeError("prompt logprobs were asked for but the engine returned none")
    return lps

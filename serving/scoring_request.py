"""Request fields for scoring and search: prompt logprobs (OpenAI
``echo`` + ``logprobs``, vLLM's ``prompt_logprobs``, TGI's ``decoder_input_details``),
``best_of``, beam search (vLLM's ``use_beam_search`` with ``length_penalty`` /
``early_stopping``; ``num_beams`` on TGI's parameters) and the watermark (TGI's
``watermark: true``; the same field, or ``{"gamma": g, "delta": d}``, on OpenAI routes).

Each parser returns ``SamplingParams`` keywords (only those that are set); the engine
validates the combinations (jaxinfer/sampling_params.py), and its messages come back as 400 /
422 naming the field. The responses' shapes are serving/scoring_response.py.
"""

from __future__ import annotations

from typing import Any

from jaxinfer.sampling_params import SamplingParams
from serving.errors import bad
from serving.fields import Fields, Limits, type_name

_SEARCH_ONLY = ("length_penalty", "early_stopping")


def openai_search(f: Fields, limits: Limits, *, n: int, echo: bool, logprobs: int | None,
                  stream: bool) -> dict[str, Any]:
    """/v1/completions: prompt logprobs, best_of, beam search."""
    out: dict[str, Any] = {}
    plp = f.int("prompt_logprobs", None, bound=SamplingParams.BOUNDS["prompt_logprobs"])
    if echo and logprobs is not None:          # OpenAI: the echoed prompt carries logprobs too
        plp = max(plp or 0, logprobs)
    if plp is not None:
        out["prompt_logprobs"] = plp
    best_of = f.int("best_of", None, bound=SamplingParams.BOUNDS["best_of"])
    if best_of is not None and best_of > limits.max_n:
        raise bad("best_of", f"must be <= {limits.max_n} on this server, got {best_of}")
    if f.bool("use_beam_search", False):
        if stream:
            raise bad("use_beam_search", "beam search cannot stream (the beams change until the end)",
                      code="unsupported")
        width = best_of or n
        if width < 2:
            raise bad("best_of", "use_beam_search needs a beam width: best_of (or n) of at least 2")
        out.update(beam_width=width, length_penalty=f.num("length_penalty", 1.0),
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
    raise bad(f.name("early_stopping"), f'must be true, false or "never", got {type_name(v)}')


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
    raise bad(f.name("watermark"), f"must be a boolean or an object with gamma and delta, got {type_name(v)}")

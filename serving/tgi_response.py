"""TGI ``generate`` bodies and ``generate_stream`` events from the engine's output."""

from __future__ import annotations

from typing import Any

from jaxinfer.outputs import CompletionOutput, Logprob, RequestOutput
from serving.request import GenRequest
from serving.scoring_response import tgi_prefill
from serving.stream import DeltaTracker
from serving.token_texts import TokenTexts, finite


def tgi_finish_reason(o: CompletionOutput) -> str:
    if o.finish_reason == "length":
        return "length"
    if o.finish_reason == "stop":
        return "stop_sequence" if isinstance(o.stop_reason, str) else "eos_token"
    return o.finish_reason or "length"


def _tgi_token(tid: int, text: str, lp: Logprob | None, special: set[int]) -> dict:
    return {"id": tid, "text": text, "logprob": finite(lp.logprob) if lp is not None else None,
            "special": tid in special}


def _tgi_top(lp: Logprob | None, k: int | None, texts: TokenTexts, special: set[int]) -> list[dict]:
    if lp is None or not k:
        return []
    return [{"id": tid, "text": texts(tid), "logprob": finite(v), "special": tid in special}
            for tid, v in lp.top[:k]]


def tgi_response(req: GenRequest, out: RequestOutput, texts: TokenTexts, special: set[int]) -> dict:
    o = out.outputs[0]
    body: dict[str, Any] = {"generated_text": (req.prompt_text if req.return_full_text else "") + o.text}
    if req.tgi_details:
        lps = o.logprobs or []
        tokens = [_tgi_token(t, texts(t), lps[j] if j < len(lps) else None, special)
                  for j, t in enumerate(o.token_ids)]
        prefill = [] if req.params.prompt_logprobs is None else tgi_prefill(out, texts)
        details: dict[str, Any] = {"finish_reason": tgi_finish_reason(o), "generated_tokens": len(o.token_ids),
                                   "seed": req.params.seed, "prefill": prefill, "tokens": tokens}
        if req.top_logprobs:
            details["top_tokens"] = [_tgi_top(lps[j] if j < len(lps) else None, req.top_logprobs,
                                              texts, special) for j in range(len(o.token_ids))]
        body["details"] = details
    return body


class TGIStreamer:
    """TGI ``generate_stream`` events: one per token; the last carries generated_text and details.

    A token's ``text`` is the new text that arrived with it; when several tokens arrive
    together (or text was held back) the earlier ones carry "" and the last carries it all,
    so the concatenated token texts always equal ``generated_text``.
    """

    def __init__(self, req: GenRequest, texts: TokenTexts, special: set[int]) -> None:
        self.req = req
        self.texts = texts
        self.special = special
        self.tracker = DeltaTracker(1)
        self.count = 0

    def events(self, out: RequestOutput) -> list[dict]:
        res = []
        for d in self.tracker.deltas(out):
            lps = d.logprobs or []
            for j, tid in enumerate(d.token_ids):
                last = j == len(d.token_ids) - 1
                lp = lps[j] if j < len(lps) else None
                self.count += 1
                ev: dict[str, Any] = {"index": self.count,
                                      "token": _tgi_token(tid, d.text if last else "", lp, self.special),
                                      "generated_text": None, "details": None}
                if self.req.top_logprobs:
                    ev["top_tokens"] = _tgi_top(lp, self.req.top_logprobs, self.texts, self.special)
                if last and d.finish_reason is not None:
                    o = out.outputs[0]
                    ev["generated_text"] = (self.req.prompt_text if self.req.return_full_text else "") + o.text
                    ev["details"] = {"finish_reason": tgi_finish_reason(o),
                                     "generated_tokens": len(o.token_ids), "seed": self.req.params.seed}
                res.append(ev)
        return res

"""Cumulative engine outputs -> per-choice deltas, for the streamed responses."""

from __future__ import annotations

from dataclasses import dataclass

from jaxinfer.outputs import Logprob, RequestOutput


@dataclass(slots=True)
class Delta:
    """New text / tokens of one choice since the last delta that was emitted for it."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprob] | None
    finish_reason: str | None
    stop_reason: str | int | None
    first: bool                   # the first delta of this choice


class DeltaTracker:
    """Cuts the engine's cumulative outputs into deltas per choice.

    A choice is emitted when it has new text or has just finished; tokens whose text is
    still held back (a possible stop string, an incomplete character) ride along with the
    next emitted delta, so text and logprobs stay aligned.
    """

    def __init__(self, n: int) -> None:
        self.text_len = [0] * n
        self.ntok = [0] * n
        self.done = [False] * n
        self.started = [False] * n

    def deltas(self, out: RequestOutput) -> list[Delta]:
        res = []
        for o in out.outputs:
            i = o.index
            if self.done[i]:
                continue
            # Cumulative text only grows (the engine holds back what it may retract); a
            # shorter snapshot would be an engine bug, and what was sent cannot be unsent.
            text = o.text[self.text_len[i]:]
            if not text and o.finish_reason is None:
                continue
            new = o.token_ids[self.ntok[i]:]
            lps = o.logprobs[self.ntok[i]:] if o.logprobs is not None else None
            res.append(Delta(i, text, list(new), lps, o.finish_reason, o.stop_reason, not self.started[i]))
            self.text_len[i] = max(self.text_len[i], len(o.text))
            self.ntok[i] = len(o.token_ids)
            self.started[i] = True
            self.done[i] = o.finish_reason is not None
        return res

"""OpenAI response bodies and stream chunks from the engine's ``RequestOutput``."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxinfer.outputs import Logprob, RequestOutput
from serving import scoring_response as SR
from serving.reasoning import ReasoningStream
from serving.request import GenRequest
from serving.tools import parse_tool_calls, stream_tool_deltas
from serving.stream import Delta, DeltaTracker
from serving.token_texts import TokenTexts, finite


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def output_usage(req: GenRequest, out: RequestOutput | None) -> dict:
    gen = sum(len(o.token_ids) for o in out.outputs) if out is not None else 0
    return usage(len(req.prompt_ids), gen)


def completion_logprobs(lps: Sequence[Logprob], k: int, texts: TokenTexts, offset: int) -> tuple[dict, int]:
    """OpenAI completions ``logprobs`` for these tokens; returns it and the next text offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        t = texts(lp.token_id)
        tokens.append(t)
        token_lps.append(finite(lp.logprob))
        top = {texts(tid): finite(v) for tid, v in lp.top[:k]}
        top.setdefault(t, finite(lp.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}, offset


def _chat_lp_entry(texts: TokenTexts, tid: int, logprob: float) -> dict:
    return {"token": texts(tid), "logprob": finite(logprob), "bytes": list(texts.bytes(tid))}


def chat_logprobs(lps: Sequence[Logprob], k: int, texts: TokenTexts) -> dict:
    content = []
    for lp in lps:
        e = _chat_lp_entry(texts, lp.token_id, lp.logprob)
        e["top_logprobs"] = [_chat_lp_entry(texts, tid, v) for tid, v in lp.top[:k]]
        content.append(e)
    return {"content": content, "refusal": None}


def completion_id(req: GenRequest) -> str:
    return ("chatcmpl-" if req.kind == "chat" else "cmpl-") + req.request_id


def completion_response(req: GenRequest, out: RequestOutput, texts: TokenTexts) -> dict:
    choices = []
    for o in out.outputs:
        prefix = req.prompt_text if req.echo else ""
        lp = None
        if req.top_logprobs is not None and o.logprobs is not None:
            lp, _ = completion_logprobs(o.logprobs, req.top_logprobs, texts, len(prefix))
        if req.echo and req.top_logprobs is not None:     # the echoed prompt's logprobs first
            lp = SR.join_logprobs(SR.echo_logprobs(out, req.top_logprobs, texts)[0], lp)
        choices.append({"index": o.index, "text": prefix + o.text, "logprobs": lp,
                        "finish_reason": o.finish_reason, "stop_reason": o.stop_reason, **SR.search_fields(o)})
        if req.prompt_logprobs:
            choices[-1]["prompt_logprobs"] = SR.vllm_prompt_logprobs(out, texts)
    return {"id": completion_id(req), "object": "text_completion", "created": req.created,
            "model": req.model, "choices": choices, "usage": output_usage(req, out)}


def chat_message(req: GenRequest, text: str) -> tuple[dict, bool]:
    """A choice's assistant message from its whole text -> (message, whether it is tool
    calls): the reasoning split off first (``--reasoning-parser``), then the tool calls
    parsed out of the content that is left."""
    message: dict = {"role": "assistant", "content": text}
    if req.reasoning is not None:
        thought, text = req.reasoning.split(text)
        message = {"role": "assistant", "content": text or None,
                   **reasoning_fields(None if req.reasoning.hidden else thought)}
    message["tool_calls"] = []
    if req.tools is not None:
        content, calls = parse_tool_calls(text, req.tools)
        if calls:
            message.update(content=content, tool_calls=calls)
            return message, True
    return message, False


def reasoning_fields(thought: str | None) -> dict:
    """The reasoning as OpenAI-compatible servers name it: ``reasoning_content`` (DeepSeek's
    API, older vLLM) and ``reasoning`` (vLLM's name since 0.11; the only one in 0.32)."""
    return {"reasoning_content": thought, "reasoning": thought}


def chat_response(req: GenRequest, out: RequestOutput, texts: TokenTexts) -> dict:
    choices = []
    for o in out.outputs:
        lp = None
        if req.top_logprobs is not None and o.logprobs is not None:
            lp = chat_logprobs(o.logprobs, req.top_logprobs, texts)
        message, called = chat_message(req, o.text)
        choices.append({"index": o.index, "message": message, "logprobs": lp,
                        "finish_reason": "tool_calls" if called else o.finish_reason,
                        "stop_reason": o.stop_reason})
    return {"id": completion_id(req), "object": "chat.completion", "created": req.created,
            "model": req.model, "choices": choices, "usage": output_usage(req, out),
            "system_fingerprint": None}


class OpenAIStreamer:
    """Builds the SSE chunks of a streamed completion or chat completion."""

    def __init__(self, req: GenRequest, texts: TokenTexts) -> None:
        self.req = req
        self.texts = texts
        self.tracker = DeltaTracker(req.params.n)
        self.offsets = [len(req.prompt_text) if req.echo else 0] * req.params.n
        self.held: dict[int, str] = {}      # chat with tools: each choice's text until it ends
        self.thinking: dict[int, ReasoningStream] = {}   # --reasoning-parser: each choice's split
        self.out: RequestOutput | None = None   # the output the chunks being built come from

    def _chunk(self, choices: list[dict]) -> dict:
        kind = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        c = {"id": completion_id(self.req), "object": kind, "created": self.req.created,
             "model": self.req.model, "choices": choices}
        if self.req.include_usage:      # continuous: the tokens so far, as vLLM reports them
            c["usage"] = output_usage(self.req, self.out) if self.req.continuous_usage else None
        return c

    def chunks(self, out: RequestOutput) -> list[dict]:
        self.out = out
        res = []
        for d in self.tracker.deltas(out):
            if self.req.kind == "chat":
                res.extend(self._chat_chunks(d))
            else:
                res.append(self._completion_chunk(d, out))
        return res

    def _completion_chunk(self, d: Delta, out: RequestOutput) -> dict:
        text = (self.req.prompt_text if self.req.echo and d.first else "") + d.text
        lp = None
        if self.req.top_logprobs is not None and d.logprobs is not None:
            if d.first and self.req.echo:
                self.offsets[d.index] = len(self.req.prompt_text)
            lp, self.offsets[d.index] = completion_logprobs(d.logprobs, self.req.top_logprobs,
                                                            self.texts, self.offsets[d.index])
        if d.first and self.req.echo and self.req.top_logprobs is not None:
            lp = SR.join_logprobs(SR.echo_logprobs(out, self.req.top_logprobs, self.texts)[0], lp)
        choice = {"index": d.index, "text": text, "logprobs": lp, "finish_reason": d.finish_reason,
                  "stop_reason": d.stop_reason}
        if d.first and self.req.prompt_logprobs:
            choice["prompt_logprobs"] = SR.vllm_prompt_logprobs(out, self.texts)
        return self._chunk([choice])

    def _chat_chunks(self, d: Delta) -> list[dict]:
        res = []
        if d.first:   # OpenAI opens each choice with the role
            res.append(self._chunk([{"index": d.index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]))
        thought, d = self._think(d) if self.req.reasoning is not None else ("", d)
        if self.req.tools is not None:
            # A reply may turn out to be tool calls: its text is held until it ends.
            if thought:
                res.append(self._chunk([{"index": d.index, "delta": reasoning_fields(thought),
                                         "logprobs": None, "finish_reason": None}]))
            return res + [self._chunk([c]) for c in stream_tool_deltas(self, d)]
        lp = None
        if self.req.top_logprobs is not None and d.logprobs is not None:
            lp = chat_logprobs(d.logprobs, self.req.top_logprobs, self.texts)
        delta = reasoning_fields(thought) if thought else {}
        if d.text:
            delta["content"] = d.text
        if delta or lp is not None or d.finish_reason is not None:   # else all of it is held back
            res.append(self._chunk([{"index": d.index, "delta": delta, "logprobs": lp,
                                     "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}]))
        return res

    def _think(self, d: Delta) -> tuple[str, Delta]:
        """Split a choice's delta into its reasoning text and a delta of its content."""
        s = self.thinking.get(d.index)
        if s is None:
            s = self.thinking[d.index] = self.req.reasoning.stream()
        thought, content = s.feed(d.text)
        if d.finish_reason is not None:
            more_thought, more = s.finish()
            thought, content = thought + more_thought, content + more
        return ("" if self.req.reasoning.hidden else thought), dataclasses.replace(d, text=content)

    def usage_chunk(self, out: RequestOutput | None) -> dict:
        kind = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        return {"id": completion_id(self.req), "object": kind, "created": self.req.created,
                "model": self.req.model, "choices": [], "usage": output_usage(self.req, out)}

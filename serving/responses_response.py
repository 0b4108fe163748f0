"""The Responses API's answers: the response object, its output items, its stream of
events, and the ``Dialect`` that puts them on the one generation path (serving/app.py).

Output items come from the model's text in one function, ``output_items``: with
``--reasoning-parser`` first a ``reasoning`` item (serving/reasoning.py's split; streamed,
its text goes out as the parser decides it), then a ``message`` (the text outside any
tool calls) and one ``function_call`` item per call. With tools and
``tool_choice: auto`` the text streams up to where a ``<tool_call>`` tag begins (as the chat
route's does); from there, and for required / named choices from the start, it is held
until the answer ends, then parsed. The streamed answer's items and the non-streamed
answer's are built by the same function from the same final text, so they are equal.

A finished response is stored (when the request's ``store`` is true) in the server's
``ResponseStore`` with its conversation; one too large to store is answered with
``"store": false``.
"""

from __future__ import annotations

from typing import Iterable

from jaxinfer.outputs import RequestOutput
from serving.dialect import OPENAI, Dialect, sse
from serving.request import GenRequest
from serving.responses_store import ResponseStore
from serving.tools import ToolSpec, hold_tool_text, parse_tool_calls


def message_id(req: GenRequest) -> str:
    return "msg_" + req.request_id


def split_reply(text: str, spec: ToolSpec | None, parallel: bool = True) -> tuple[str, list[dict]]:
    """(the message's text, the tool calls in chat's shape). The part of the text a stream
    sends before it holds the rest (``hold_tool_text``) is kept as it is; the held rest is
    parsed for calls. Split at once or delta by delta, the cut is the same."""
    if spec is None:
        return text, []
    now, held = hold_tool_text("", text, spec)
    if not held:
        return text, []
    rest, calls = parse_tool_calls(held, spec)
    return now + (rest or ""), calls if parallel else calls[:1]


def reasoning_id(req: GenRequest) -> str:
    return "rs_" + req.request_id


def reasoning_item(req: GenRequest, thought: str, status: str = "completed") -> dict:
    return {"id": reasoning_id(req), "type": "reasoning", "summary": [],
            "content": [_reasoning_part(thought)], "status": status}


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def output_items(req: GenRequest, text: str, status: str) -> list[dict]:
    """The response's output items from the model's text (the one place they are built):
    the thinking split off first (``--reasoning-parser``), then message and calls."""
    items = []
    if req.reasoning is not None:
        thought, text = req.reasoning.split(text)
        if thought is not None:
            items.append(reasoning_item(req, thought))
    content, calls = split_reply(text, req.tools, req.api.parallel_tool_calls)
    if content or not calls:
        items.append({"id": message_id(req), "type": "message", "role": "assistant",
                      "status": "incomplete" if status == "incomplete" else "completed",
                      "content": [_text_part(content)]})
    for i, c in enumerate(calls):
        fn = c["function"]
        items.append({"id": f"fc_{req.request_id}_{i}", "type": "function_call", "call_id": c["id"],
                      "name": fn["name"], "arguments": fn["arguments"], "status": "completed"})
    return items


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def conversation_items(output: list[dict]) -> list[dict]:
    """Output items as the next turn's input items (what ``previous_response_id`` prepends)."""
    out = []
    for it in output:
        if it["type"] == "message":
            out.append({"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": p["text"]} for p in it["content"]]})
        elif it["type"] == "function_call":
            out.append({"type": "function_call", "call_id": it["call_id"], "name": it["name"],
                        "arguments": it["arguments"]})
    return out


def usage(req: GenRequest, out: RequestOutput | None) -> dict | None:
    if out is None:
        return None
    n = sum(len(o.token_ids) for o in out.outputs)
    return {"input_tokens": len(req.prompt_ids), "output_tokens": n,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": len(req.prompt_ids) + n}


def response_object(req: GenRequest, status: str, output: list[dict], out: RequestOutput | None,
                    error: dict | None = None) -> dict:
    return {"id": req.api.id, "object": "response", "created_at": req.created, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": req.model, "output": output, "usage": usage(req, out), **req.api.echo}


def final_status(out: RequestOutput) -> str:
    reason = out.outputs[0].finish_reason
    return {"length": "incomplete", "abort": "failed"}.get(reason, "completed")


def finish(req: GenRequest, out: RequestOutput, store: ResponseStore,
           output: list[dict] | None = None) -> dict:
    """The final response object, stored when the request asked (``store`` false in it when
    it is too large to keep)."""
    status = final_status(out)
    if output is None:
        output = output_items(req, out.outputs[0].text, status)
    resp = response_object(req, status, output, out)
    if req.api.store and status != "failed":
        if not store.put(req.api.id, resp, req.api.conversation + tuple(conversation_items(output))):
            resp["store"] = False
    return resp


class ResponsesStream:
    """The event stream of one response (OpenAI's order: created, in_progress, then per
    item added / content / done, then completed or incomplete); each event has an
    ``event:`` line, a ``type`` and a ``sequence_number``."""

    def __init__(self, req: GenRequest, store: ResponseStore) -> None:
        self.req, self.store = req, store
        self.seq, self.sent, self.opened, self.started = 0, 0, False, False
        self.held = ""      # with tools: text that may turn out to be a call (hold_tool_text)
        self.read = 0       # the model's text read so far (thinking and content)
        self.thinking = req.reasoning.stream() if req.reasoning is not None else None
        self.thought = ""   # the reasoning item's text streamed so far
        self.msg_index = 0  # the message's output_index: 1 once a reasoning item went before it
        self.thinking_open = False

    def _ev(self, kind: str, **fields: object) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(obj, event=kind)

    def _begin(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        r = response_object(self.req, "in_progress", [], None)
        return [self._ev("response.created", response=r), self._ev("response.in_progress", response=r)]


    def _open(self) -> list[bytes]:
        self.opened = True
        item = {"id": message_id(self.req), "type": "message", "role": "assistant", "status": "in_progress",
                "content": []}
        i = self.msg_index
        return [self._ev("response.output_item.added", output_index=i, item=item),
                self._ev("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                         part=_text_part(""))]

    def _delta(self, delta: str) -> list[bytes]:
        chunks = [] if self.opened else self._open()
        self.sent += len(delta)
        return chunks + [self._ev("response.output_text.delta", item_id=message_id(self.req),
                                  output_index=self.msg_index, content_index=0, delta=delta, logprobs=[])]

    def _think(self, new: str, last: bool) -> tuple[list[bytes], str]:
        """New model text -> (the reasoning item's events, the content's text): the parser's
        split; the reasoning item closes as soon as content (or the end) comes."""
        if self.thinking is None:
            return [], new
        thought, content = self.thinking.feed(new)
        if last:
            more_thought, more = self.thinking.finish()
            thought, content = thought + more_thought, content + more
        chunks = []
        ids = dict(item_id=reasoning_id(self.req), output_index=0, content_index=0)
        if thought:
            if not self.thinking_open:
                self.thinking_open, self.msg_index = True, 1
                chunks += [self._ev("response.output_item.added", output_index=0,
                                    item={**reasoning_item(self.req, "", "in_progress"), "content": []}),
                           self._ev("response.content_part.added", **ids, part=_reasoning_part(""))]
            self.thought += thought
            chunks.append(self._ev("response.reasoning_text.delta", **ids, delta=thought))
        if (content or last) and self.thinking_open:
            self.thinking_open = False
            item = reasoning_item(self.req, self.thought)
            chunks += [self._ev("response.reasoning_text.done", **ids, text=self.thought),
                       self._ev("response.content_part.done", **ids, part=item["content"][0]),
                       self._ev("response.output_item.done", output_index=0, item=item)]
        return chunks, content

    def events(self, out: RequestOutput) -> Iterable[bytes]:
        chunks = self._begin()
        text = out.outputs[0].text
        more, new = self._think(text[self.read:], False)
        self.read = len(text)
        chunks += more
        if self.req.tools is not None:
            new, self.held = hold_tool_text(self.held, new, self.req.tools)
        if new:
            chunks += self._delta(new)
        return chunks

    def end(self, last: RequestOutput) -> Iterable[bytes]:
        chunks = self._begin()
        if final_status(last) == "failed":
            return chunks + list(self.failure("the request was aborted by the server (shutting down?)", "aborted"))
        text = last.outputs[0].text
        chunks += self._think(text[self.read:], True)[0]     # the content's rest: _message_done sends it
        self.read = len(text)
        output = output_items(self.req, text, final_status(last))
        for index, item in enumerate(output):
            if item["type"] == "message":
                chunks += self._message_done(item)
            elif item["type"] == "function_call":
                chunks += self._call_events(index, item)
        resp = finish(self.req, last, self.store, output)
        kind = "response.completed" if resp["status"] == "completed" else "response.incomplete"
        return chunks + [self._ev(kind, response=resp)]

    def _message_done(self, item: dict) -> list[bytes]:
        text = item["content"][0]["text"]
        # the text streamed so far is a prefix of the message's (split_reply keeps it as is)
        chunks = self._delta(text[self.sent:]) if len(text) > self.sent else []
        if not self.opened:
            chunks += self._open()
        ids = dict(item_id=item["id"], output_index=self.msg_index, content_index=0)
        return chunks + [self._ev("response.output_text.done", **ids, text=text, logprobs=[]),
                         self._ev("response.content_part.done", **ids, part=item["content"][0]),
                         self._ev("response.output_item.done", output_index=self.msg_index, item=item)]

    def _call_events(self, index: int, item: dict) -> list[bytes]:
        ids = dict(item_id=item["id"], output_index=index)
        return [self._ev("response.output_item.added", output_index=index,
                         item={**item, "arguments": "", "status": "in_progress"}),
                self._ev("response.function_call_arguments.delta", **ids, delta=item["arguments"]),
                self._ev("response.function_call_arguments.done", **ids, arguments=item["arguments"],
                         name=item["name"]),
                self._ev("response.output_item.done", output_index=index, item=item)]

    def failure(self, message: str, code: str) -> Iterable[bytes]:
        err = {"code": code, "message": message}
        resp = response_object(self.req, "failed", [], None, error=err)
        return self._begin() + [self._ev("error", code=code, message=message, param=None),
                                self._ev("response.failed", response=resp)]


def responses_dialect(store: ResponseStore) -> Dialect:
    """The Responses API's Dialect over ``store``: OpenAI's error shape, the response
    object, the event stream."""
    return Dialect("responses", OPENAI.error,
                   lambda req, out, a: finish(req, out, store),
                   lambda req, a: ResponsesStream(req, store))

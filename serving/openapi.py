"""The OpenAPI description of the routes."""

from __future__ import annotations

from typing import Any

from jaxinfer.bounds import PRIORITY
from jaxinfer.sampling_params import SamplingParams
from serving import anthropic_request as AR
from serving.fields import MAX_STOP, SEED_MAX, SEED_MIN
from serving.openai_request import CHAT_ROLES


_INT, _NUM, _BOOL, _STR = {"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "string"}
_STOP = {"oneOf": [_STR, {"type": "array", "items": _STR, "maxItems": MAX_STOP}]}
_B = {k: b.schema() for k, b in SamplingParams.BOUNDS.items()}
_SAMPLING = dict(
    **{k: _B[k] for k in ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                          "repetition_penalty", "max_tokens", "min_tokens")},
    seed={**_INT, "minimum": SEED_MIN, "maximum": SEED_MAX},
    stop=_STOP, stop_token_ids={"type": "array", "items": {**_INT, "minimum": 0}},
    logit_bias={"type": "object", "additionalProperties": {**_NUM, "minimum": -100, "maximum": 100}},
    ignore_eos=_BOOL, include_stop_str_in_output=_BOOL, skip_special_tokens=_BOOL,
    stream=_BOOL, stream_options={"type": "object", "properties": {"include_usage": _BOOL}},
    model=_STR,
    cache_salt={**_STR, "minLength": 1, "maxLength": SamplingParams.MAX_CACHE_SALT_CHARS},
    watermark={"oneOf": [_BOOL, {"type": "object", "properties": {"gamma": _NUM, "delta": _NUM}}]},
    priority=PRIORITY.schema(),
)
_EARLY = {"oneOf": [_BOOL, {"const": "never"}]}


def _tokenizer_paths(post: Any, messages: dict) -> dict:
    """vLLM's /tokenize and /detokenize (``post``: a path's description from its body;
    ``messages``: the chat route's schema of them)."""
    tokenize = {"type": "object", "properties": {
        "model": _STR, "prompt": _STR, "messages": messages, "add_special_tokens": _BOOL,
        "add_generation_prompt": _BOOL, "return_token_strs": _BOOL}}
    detokenize = {"type": "object", "required": ["tokens"], "properties": {
        "model": _STR, "tokens": {"type": "array", "items": {**_INT, "minimum": 0}}}}
    return {"/tokenize": post("vLLM tokenize: a prompt or chat messages -> token ids", tokenize, stream=False),
            "/detokenize": post("vLLM detokenize: token ids -> text", detokenize, stream=False)}


def _anthropic(count: bool) -> dict:
    """The Messages API body (``count``: count_tokens', which has no max_tokens or sampling)."""
    text = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {**_STR, "maxLength": AR.MAX_TEXT_CHARS}}}
    ident = {**_STR, "minLength": 1, "maxLength": AR.MAX_ID_CHARS}
    block = {"oneOf": [text, {"type": "object", "required": ["type", "id", "name"], "properties": {
        "type": {"const": "tool_use"}, "id": ident, "name": ident, "input": {"type": "object"}}},
        {"type": "object", "required": ["type", "tool_use_id"], "properties": {
            "type": {"const": "tool_result"}, "tool_use_id": ident, "is_error": _BOOL,
            "content": {"oneOf": [_STR, {"type": "array", "items": text}]}}}]}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": list(AR.ROLES)},
        "content": {"oneOf": [_STR, {"type": "array", "items": block, "maxItems": AR.MAX_BLOCKS}]}}}
    tool = {"type": "object", "required": ["name"], "properties": {
        "name": _STR, "description": _STR, "input_schema": {"type": "object"}}}
    props = {"model": _STR, "system": {"oneOf": [_STR, {"type": "array", "items": text}]},
             "messages": {"type": "array", "items": message, "minItems": 1, "maxItems": AR.MAX_MESSAGES},
             "tools": {"type": "array", "items": tool}, "tool_choice": {"type": "object", "required": ["type"],
             "properties": {"type": {"enum": ["auto", "any", "tool", "none"]}, "name": _STR,
                            "disable_parallel_tool_use": _BOOL}}}
    if not count:
        props.update(max_tokens=_B["max_tokens"], temperature=_B["temperature"], top_p=_B["top_p"],
                     top_k={**_INT, "minimum": 0}, stream=_BOOL,
                     stop_sequences={"type": "array", "items": _STR, "maxItems": MAX_STOP},
                     metadata={"type": "object", "properties": {"user_id": {**_STR, "maxLength": AR.MAX_ID_CHARS}}})
    return {"type": "object", "required": ["model", "messages"] + ([] if count else ["max_tokens"]),
            "properties": props}


def _completion_body() -> dict:
    """/v1/completions' request body."""
    completion = {"type": "object", "required": ["prompt"], "properties": {
        **_SAMPLING, "prompt": {"oneOf": [_STR, {"type": "array", "items": _STR, "maxItems": 1},
                                          {"type": "array", "items": {**_INT, "minimum": 0}}]},
        "echo": _BOOL, "logprobs": _B["logprobs"], "prompt_logprobs": _B["prompt_logprobs"],
        "best_of": _B["best_of"], "use_beam_search": _BOOL, "length_penalty": _B["length_penalty"], "early_stopping": _EARLY}}
    return completion


def _chat_body() -> dict:
    """/v1/chat/completions' request body."""
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": _STR}}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": list(CHAT_ROLES)},
        "content": {"oneOf": [_STR, {"type": "array", "items": part}, {"type": "null"}]}}}
    chat = {"type": "object", "required": ["messages"], "properties": {
        **_SAMPLING, "messages": {"type": "array", "items": message, "minItems": 1},
        "max_completion_tokens": _B["max_tokens"], "logprobs": _BOOL,
        "top_logprobs": _B["logprobs"],
        "add_generation_prompt": _BOOL}}
    return chat


def _tgi_body() -> dict:
    """TGI /generate's request body."""
    tgi = {"type": "object", "required": ["inputs"], "properties": {
        "inputs": {**_STR, "minLength": 1},
        "parameters": {"type": "object", "properties": dict(
            max_new_tokens=_B["max_tokens"], temperature={**_NUM, "exclusiveMinimum": 0},
            top_p={**_NUM, "exclusiveMinimum": 0, "maximum": 1}, top_k={**_INT, "minimum": 1},
            repetition_penalty={**_NUM, "exclusiveMinimum": 0}, frequency_penalty={**_NUM, "minimum": -2, "maximum": 2},
            seed={**_INT, "minimum": 0}, stop={"type": "array", "items": _STR}, do_sample=_BOOL, details=_BOOL,
            return_full_text=_BOOL, top_n_tokens=_B["logprobs"], watermark=_BOOL, decoder_input_details=_BOOL,
            num_beams=_B["beam_width"], length_penalty=_B["length_penalty"], early_stopping=_EARLY)}}}
    return tgi


def _responses_body() -> dict:
    """/v1/responses' request body."""
    item = {"type": "object", "properties": {
        "type": {"enum": ["message", "function_call", "function_call_output"]},
        "role": {"enum": ["user", "system", "developer", "assistant"]}, "content": {}, "call_id": _STR,
        "name": _STR, "arguments": _STR, "output": {}}}
    responses = {"type": "object", "required": ["input"], "properties": {
        "model": _STR, "input": {"oneOf": [_STR, {"type": "array", "items": item, "minItems": 1}]},
        "instructions": _STR, "previous_response_id": _STR, "temperature": _B["temperature"],
        "top_p": _B["top_p"], "max_output_tokens": _B["max_tokens"], "stream": _BOOL, "store": _BOOL,
        "tools": {"type": "array", "items": {"type": "object"}}, "tool_choice": {},
        "parallel_tool_calls": _BOOL, "text": {"type": "object"}, "metadata": {"type": "object"},
        "user": _STR, "truncation": {"const": "disabled"}, "include": {"type": "array", "items": _STR}}}
    return responses


def openapi_schema() -> dict:
    """A hand-kept OpenAPI 3.1 description of the routes and their request bodies."""
    err = {"description": "error", "content": {"application/json": {"schema": {"type": "object"}}}}
    ok_json = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
    ok_sse = {"description": "OK (JSON, or server-sent events when stream is true)",
              "content": {"application/json": {}, "text/event-stream": {}}}

    def post(summary: str, schema: dict, stream: bool = True) -> dict:
        return {"post": {"summary": summary,
                         "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                         "responses": {"200": ok_sse if stream else ok_json, "400": err, "401": err,
                                       "413": err, "422": err, "503": err}}}

    chat = _chat_body()
    get = {"get": {"responses": {"200": ok_json}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxinfer", "version": "0.1.0",
                 "description": "OpenAI-, TGI- and Anthropic-compatible LLM serving on JAX"},
        "paths": {
            "/v1/completions": post("OpenAI text completion", _completion_body()),
            "/v1/chat/completions": post("OpenAI chat completion", chat),
            "/v1/responses": post("OpenAI Responses API", _responses_body()),
            "/v1/responses/{response_id}": {**get, "delete": {"responses": {"200": ok_json, "404": err}}},
            "/v1/models": get, "/v1/models/{model}": get,
            "/generate": post("TGI generate", _tgi_body(), stream=False),
            "/generate_stream": post("TGI generate, streamed", _tgi_body()),
            "/v1/messages": post("Anthropic Messages", _anthropic(False)),
            "/v1/messages/count_tokens": post("Anthropic Messages: count the prompt's tokens", _anthropic(True),
                                              stream=False),
            **_tokenizer_paths(post, chat["properties"]["messages"]),
            "/info": get, "/health": {"get": {"responses": {"200": ok_json, "503": err}}},
            "/metrics": {"get": {"responses": {"200": {"description": "Prometheus text format"}}}},
        },
    }

"""The validated request every route parses into, and what the parsers share: the
model check, max-token resolution, ``SamplingParams`` errors renamed to API fields, and
tokenization."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from jaxinfer.sampling_params import SamplingParams
from serving import tools as T
from serving.errors import bad
from serving.fields import Fields, Limits, short


@dataclass(slots=True)
class GenRequest:
    """One validated generation request, ready for ``engine.generate``."""

    kind: str                      # "completion" | "chat" | "tgi" | "messages" | "responses"
    model: str
    prompt_ids: list[int]
    prompt_text: str               # for echo / return_full_text
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False   # vLLM's stream_options.continuous_usage_stats: usage in every chunk
    echo: bool = False
    top_logprobs: int | None = None   # None: no logprobs in the response; k: chosen + top k
    tgi_details: bool = False
    return_full_text: bool = False
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field in the response
    tools: Any = None              # serving.tools.ToolSpec: parse the reply for tool calls
    reasoning: Any = None          # serving.reasoning.ReasoningParser: split the thinking off the reply
    api: Any = None                # what one API's answer needs besides these (Responses: a ResponsesCall)
    priority: int = 0              # vLLM's field: lower runs first (only under --scheduling-policy priority)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def check_model(f: Fields, limits: Limits) -> str:
    model = f.str("model")
    if model is None:
        return limits.model_names[0]
    if model not in limits.model_names:
        raise bad("model", f"model {short(model)} is not served here; available: "
                  f"{', '.join(limits.model_names)}", code="model_not_found")
    return model


def resolve_max_tokens(requested: int | None, default: int | None, prompt_len: int,
                        limits: Limits, param: str, prompt_param: str) -> int:
    room = limits.max_model_len - prompt_len
    if room < 1:
        raise bad(prompt_param, f"the prompt is {prompt_len} tokens, which leaves no room to generate "
                  f"within the context length of {limits.max_model_len} tokens",
                  code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise bad(param, f"{requested} is too large: prompt tokens ({prompt_len}) + {param} must be "
                  f"<= the context length {limits.max_model_len}, so at most {room} here",
                  code="context_length_exceeded")
    return requested


def sampling_params(aliases: dict[str, str], **kw: Any) -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        msg = str(e)
        field_name, _, rest = msg.partition(": ")
        api = aliases.get(field_name, field_name)
        raise bad(api, rest or msg) from None


def encode_text(tokenizer: Any, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """A prompt string -> token ids (special tokens added as the model expects, unless
    ``add_special_tokens`` is False), the one place the HTTP routes tokenize plain text;
    errors name ``param``."""
    try:
        ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except Exception as e:       # tokenizers reject odd input in their own ways
        raise bad(param, f"could not be tokenized: {e}") from None
    if not ids:
        raise bad(param, "tokenizes to no tokens")
    return ids


def chat_prompt_ids(messages: list[dict], tools: Any, tokenizer: Any, add_generation_prompt: bool = True,
                    param: str = "messages", template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Chat-template messages (and a serving.tools.ToolSpec or None) -> prompt ids, the one
    place every chat-shaped API renders its conversation; errors name ``param``.
    ``template_kwargs``: the template's extra variables (``chat_template_kwargs``)."""
    try:
        if tools is not None:
            ids = list(T.render_messages(messages, tools, tokenizer, template_kwargs))
        else:
            ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                     template_kwargs=template_kwargs))
    except Exception as e:
        # The tokenizer says "template_kwargs: ..." of a kwarg it refuses.
        where = "chat_template_kwargs" if str(e).startswith("template_kwargs") else param
        raise bad(where, f"could not apply the chat template: {e}") from None
    if not ids:
        raise bad(param, "the chat template produced no tokens")
    return ids


def decode_ids(tokenizer: Any, ids: list[int], param: str) -> str:
    try:
        return tokenizer.decode(ids, skip_special_tokens=False)
    except Exception as e:
        raise bad(param, f"could not be decoded: {e}") from None

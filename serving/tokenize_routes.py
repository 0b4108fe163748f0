"""vLLM's /tokenize and /detokenize, with its bodies and answers:

  POST /tokenize    {"model"?, "prompt": "text", "add_special_tokens"?: true}
                 or {"model"?, "messages": [...], "add_generation_prompt"?: true, "tools"?: [...]}
                 -> {"count": n, "max_model_len": L, "tokens": [ids], "token_strs"?: [...]}
  POST /detokenize  {"model"?, "tokens": [ids]} -> {"prompt": "text"}

A chat body is tokenized exactly as /v1/chat/completions tokenizes it (the same message
parsing, ``openai_request.openai_messages``, and template, tools and ``chat_template_kwargs``,
``request.chat_prompt_ids``), so ``count`` is that route's ``usage.prompt_tokens``; a plain prompt as /v1/completions does
(``request.encode_text``). ``return_token_strs`` adds each token's vocabulary string.
Errors come in OpenAI's shape and name the field. The body is size-capped like every
route's; ``tokens`` holds at most ``MAX_DETOKENIZE_TOKENS`` ids, each in the vocabulary.
"""

from __future__ import annotations

from typing import Any

from serving import tools as T
from serving.errors import bad
from serving.fields import Fields, Limits, check_token_ids, type_name
from serving.openai_request import openai_messages
from serving.request import chat_prompt_ids, check_model, decode_ids, encode_text

MAX_DETOKENIZE_TOKENS = 1 << 17


def tokenize(body: dict, limits: Limits, tokenizer: Any) -> dict:
    """A /tokenize body -> its answer (runs in a worker thread: templating takes a while)."""
    f = Fields(body)
    check_model(f, limits)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise bad("prompt", "give exactly one of prompt (text) or messages (a chat)")
    strs = f.bool("return_token_strs", False)
    if has_messages:
        if f.bool("add_special_tokens", False):
            raise bad("add_special_tokens", "is not supported with messages (the chat template adds "
                      "the model's special tokens itself)", code="unsupported")
        f.reject_if_set("continue_final_message", "continuing the final message")
        f.reject_if_set("chat_template", "a chat template of the request's own")
        tools = T.parse_tools(body)
        messages = openai_messages(body.get("messages"))
        ids = chat_prompt_ids(messages, tools, tokenizer, f.bool("add_generation_prompt", True),
                              template_kwargs=f.template_kwargs("chat_template_kwargs"))
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad("prompt", f"must be a string, got {type_name(prompt)}")
        if not prompt:
            raise bad("prompt", "must not be empty")
        ids = encode_text(tokenizer, prompt, "prompt", f.bool("add_special_tokens", True))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids}
    if strs:
        out["token_strs"] = [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]
    return out


def detokenize(body: dict, limits: Limits, tokenizer: Any) -> dict:
    """A /detokenize body -> {"prompt": text}."""
    f = Fields(body)
    check_model(f, limits)
    tokens = body.get("tokens")
    if tokens is None:
        raise bad("tokens", "is required")
    if not isinstance(tokens, list):
        raise bad("tokens", f"must be an array of token ids, got {type_name(tokens)}")
    if len(tokens) > MAX_DETOKENIZE_TOKENS:
        raise bad("tokens", f"at most {MAX_DETOKENIZE_TOKENS} token ids, got {len(tokens)}")
    ids = check_token_ids(tokens, "tokens", limits)
    return {"prompt": decode_ids(tokenizer, ids, "tokens") if ids else ""}

"""TGI ``/generate`` and ``/generate_stream`` bodies -> ``GenRequest``."""

from __future__ import annotations

import uuid
from typing import Any

from jaxinfer.sampling_params import SamplingParams
from serving.errors import ProtocolError, bad
from serving.fields import SEED_MAX, Fields, Limits, short, type_name
from serving.guided_protocol import tgi_grammar
from serving.request import GenRequest, encode_text, resolve_max_tokens, sampling_params
from serving.scoring_request import tgi_search


DEFAULT_TGI_MAX_NEW_TOKENS = 100      # TGI's default


def parse_tgi_request(body: dict, limits: Limits, tokenizer: Any, *, stream: bool) -> GenRequest:
    """TGI's ``{"inputs": ..., "parameters": {...}}``; TGI answers validation errors with 422."""
    try:
        return _parse_tgi(body, limits, tokenizer, stream)
    except ProtocolError as e:
        if e.status == 400:
            e.status = 422
        raise


def _parse_tgi(body: dict, limits: Limits, tokenizer: Any, stream: bool) -> GenRequest:
    inputs = body.get("inputs")
    if not isinstance(inputs, str):
        raise bad("inputs", "is required and must be a string" if inputs is None
                  else f"must be a string, got {type_name(inputs)}")
    if not inputs:
        raise bad("inputs", "must not be empty")
    raw = body.get("parameters")
    if raw is not None and not isinstance(raw, dict):
        raise bad("parameters", f"must be an object, got {type_name(raw)}")
    f = Fields(raw or {}, "parameters.")
    for key, why in (("truncate", "input truncation"),
                     ("typical_p", "typical sampling")):
        f.reject_if_set(key, why)
    f.int("best_of", None, lo=1, hi=1)
    adapter = f.str("adapter_id")       # a LoRA adapter's name (serving/lora_routes.py)
    if adapter is not None and adapter not in limits.model_names:
        raise bad("parameters.adapter_id", f"no adapter {short(adapter)} is loaded; available: "
                  f"{', '.join(limits.model_names[1:]) or 'none'}", code="model_not_found")
    temperature = f.num("temperature", None)
    if temperature is not None and temperature <= 0:
        raise bad("parameters.temperature", f"must be strictly positive, got {temperature}")
    top_p = f.num("top_p", None)
    top_k = f.top_k("top_k", None, limits, lo=1)
    do_sample = f.bool("do_sample", False)
    sample = do_sample or temperature is not None or top_p is not None or top_k is not None
    seed = f.int("seed", None, lo=0, hi=SEED_MAX)
    if sample and seed is None:
        seed = uuid.uuid4().int & SEED_MAX          # TGI reports the seed it drew
    top_n = f.int("top_n_tokens", None, bound=SamplingParams.BOUNDS["logprobs"])
    details = f.bool("details", False)
    ids = encode_text(tokenizer, inputs, "inputs")
    max_new = resolve_max_tokens(f.int("max_new_tokens", None, bound=SamplingParams.BOUNDS["max_tokens"]), DEFAULT_TGI_MAX_NEW_TOKENS,
                                  len(ids), limits, "parameters.max_new_tokens", "inputs")
    want_logprobs = stream or details
    aliases = {k: f"parameters.{k}" for k in ("temperature", "top_p", "top_k", "repetition_penalty",
                                               "frequency_penalty", "seed", "stop")}
    aliases["max_tokens"] = "parameters.max_new_tokens"
    aliases["logprobs"] = "parameters.top_n_tokens"
    aliases["beam_width"] = "parameters.num_beams"
    params = sampling_params(
        aliases,
        **tgi_grammar(f),
        **tgi_search(f, limits, stream=stream, details=details),
        max_tokens=max_new,
        temperature=(temperature if temperature is not None else 1.0) if sample else 0.0,
        top_p=top_p if top_p is not None else 1.0,
        top_k=top_k or 0,
        repetition_penalty=f.num("repetition_penalty", 1.0),
        frequency_penalty=f.num("frequency_penalty", 0.0),
        seed=seed,
        stop=f.stop("stop"),
        logprobs=(top_n or 0) if want_logprobs else None,
    )
    return GenRequest("tgi", adapter or limits.model_names[0], ids, inputs, params, stream=stream,
                      top_logprobs=top_n, tgi_details=details,
                      return_full_text=f.bool("return_full_text", False))

"""Benchmark requests: a prompt (text or token ids) and how many tokens to generate.

Sources (``--dataset-name``):
  jsonl     one JSON object per line: ``{"prompt": str}`` (or ``"text"``), or MT-Bench's
            ``{"turns": [str, ...]}`` (the first turn); optional ``"output_len"``;
  sharegpt  a JSON list of ``{"conversations": [{"from": "human", "value": ...},
            {"from": "gpt", "value": ...}, ...]}``: the first human turn is the prompt; with
            ``--sharegpt-output-len`` unset, the reply's length in characters / 4 sets the
            output length (vLLM uses the reply's token count; we have no tokenizer in serve);
  workload  the shared token-id workload (``workload_smollm2.json``): its ``throughput``
            prompts and ``new_tokens``;
  random    synthetic prompts: lengths uniform in ``len * [1 - range, 1 + range]`` for
            input and output, as vLLM's random dataset.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Every request is bounded: a benchmark file is input, and input gets limits.
MAX_REQUESTS = 1_000_000
MAX_LEN = 1 << 20
# Synthetic text for servers (their tokenizer is unknown here): one common word is about
# one token in the BPE vocabularies of Llama-family models.
_WORDS = ("the", "time", "people", "way", "water", "world", "music", "river", "light", "story",
          "number", "city", "house", "garden", "morning", "paper", "window", "market")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str | tuple[int, ...]
    output_len: int


def _check_len(name: str, v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_LEN:
        raise ValueError(f"{name}: expected an integer in [1, {MAX_LEN}], got {v!r}")
    return v


def _read_json(path: str) -> Any:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--dataset-path: no such file: {path}")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def load_jsonl(path: str, output_len: int) -> list[BenchRequest]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--dataset-path: no such file: {path}")
    out = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            turns = row.get("turns")
            prompt = row.get("prompt", row.get("text", turns[0] if isinstance(turns, list) and turns else None))
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{path}:{lineno}: no prompt (expected 'prompt', 'text' or 'turns')")
            n = row.get("output_len", output_len)
            out.append(BenchRequest(prompt, _check_len(f"{path}:{lineno}: output_len", n)))
            if len(out) >= MAX_REQUESTS:
                break
    return out


def load_sharegpt(path: str, output_len: int | None) -> list[BenchRequest]:
    data = _read_json(path)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    out = []
    for conv in data[:MAX_REQUESTS]:
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue            # ShareGPT dumps hold one-turn and empty entries; vLLM skips them too
        first, reply = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(reply, dict)):
            continue
        prompt, answer = first.get("value"), reply.get("value")
        if not isinstance(prompt, str) or not prompt or not isinstance(answer, str):
            continue
        n = output_len if output_len is not None else max(4, len(answer) // 4)
        out.append(BenchRequest(prompt, min(n, MAX_LEN)))
    if not out:
        raise ValueError(f"{path}: no conversation with a prompt and a reply")
    return out


def load_workload(path: str) -> list[BenchRequest]:
    data = _read_json(path)
    tp = data.get("throughput") if isinstance(data, dict) else None
    if not isinstance(tp, dict) or not isinstance(tp.get("prompts"), list):
        raise ValueError(f"{path}: expected the token-id workload ({{'throughput': {{'prompts': "
                         "[[ids...]], 'new_tokens': N}}}})")
    n = _check_len(f"{path}: throughput.new_tokens", tp.get("new_tokens"))
    out = []
    for i, ids in enumerate(tp["prompts"][:MAX_REQUESTS]):
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids)):
            raise ValueError(f"{path}: throughput.prompts[{i}] is not a non-empty list of token ids")
        out.append(BenchRequest(tuple(ids), n))
    return out


def _lengths(rng: random.Random, n: int, mean: int, spread: float) -> list[int]:
    lo, hi = max(1, int(mean * (1 - spread))), max(1, int(mean * (1 + spread)))
    return [rng.randint(lo, hi) for _ in range(n)]


def synthetic(n: int, input_len: int, output_len: int, spread: float, seed: int,
              vocab_size: int | None) -> list[BenchRequest]:
    """Random prompts: token ids when the vocabulary is known (in-process), else words."""
    if not 0 <= spread < 1:
        raise ValueError(f"--random-range-ratio: expected a value in [0, 1), got {spread}")
    rng = random.Random(seed)
    ins, outs = _lengths(rng, n, input_len, spread), _lengths(rng, n, output_len, spread)
    reqs = []
    for i, (a, b) in enumerate(zip(ins, outs)):
        if vocab_size:
            # Skip the low ids, where tokenizers keep their special tokens.
            prompt: str | tuple[int, ...] = tuple(rng.randrange(min(256, vocab_size // 2), vocab_size)
                                                  for _ in range(a))
        else:
            prompt = f"Request {i}: " + " ".join(rng.choice(_WORDS) for _ in range(a))
        reqs.append(BenchRequest(prompt, b))
    return reqs


def load_requests(name: str, path: str | None, num_prompts: int, *, input_len: int, output_len: int,
                  spread: float, seed: int, vocab_size: int | None,
                  sharegpt_output_len: int | None = None) -> list[BenchRequest]:
    """``num_prompts`` requests from the named source (a file's rows are cycled if fewer)."""
    if not 1 <= num_prompts <= MAX_REQUESTS:
        raise ValueError(f"--num-prompts: expected 1..{MAX_REQUESTS}, got {num_prompts}")
    _check_len("--input-len", input_len)
    _check_len("--output-len", output_len)
    if name == "random":
        return synthetic(num_prompts, input_len, output_len, spread, seed, vocab_size)
    if path is None:
        raise ValueError(f"--dataset-name {name} needs --dataset-path")
    if name == "jsonl":
        rows = load_jsonl(path, output_len)
    elif name == "sharegpt":
        rows = load_sharegpt(path, sharegpt_output_len)
    elif name == "workload":
        rows = load_workload(path)
    else:
        raise ValueError(f"--dataset-name: unknown {name!r} (jsonl, sharegpt, workload, random)")
    if not rows:
        raise ValueError(f"{path}: no requests")
    rng = random.Random(seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    return [rows[order[i % len(rows)]] for i in range(num_prompts)]

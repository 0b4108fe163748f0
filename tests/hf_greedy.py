"""transformers as the greedy oracle, in one forward per prompt (teacher forcing).

``generate()`` runs one forward per new token, and a real model's LM head (Gemma 3's is
262,144 x 640 floats) is read from memory at every one of them: 64 tokens of 8 prompts
took 35-53 s of one core. Checking a continuation instead feeds transformers the prompt
and the continuation at once: its argmax at each position, given the tokens before it,
must be the continuation's next token. By induction that is transformers' greedy
continuation, computed by its full-sequence forward rather than its cached one step by
step (the two differ only in float rounding; the tests that use this also run
``generate()`` itself on one prompt, and the run of 2026-11-27 found the argmaxes of both
ways equal on all 16 prompts of the default model and Gemma 3, the closest top-2 gap
5e-4).
"""

from __future__ import annotations

import numpy as np
import torch


def teacher_forced_logits(model, ids: list[int], continuation: list[int]) -> np.ndarray:
    """transformers' logits f32[len(continuation), V]: row j predicts continuation[j]."""
    with torch.no_grad():
        x = torch.tensor([list(ids) + list(continuation[:-1])])
        return model(x).logits[0, len(ids) - 1:].numpy()


def greedy_mismatch(model, ids: list[int], continuation: list[int]) -> str | None:
    """None when ``continuation`` is transformers' greedy continuation of ``ids`` (its
    argmax at every position, first index on ties like ``generate``), else where it is not."""
    am = teacher_forced_logits(model, ids, continuation).argmax(-1).tolist()
    if am == list(continuation):
        return None
    k = next(j for j, (a, b) in enumerate(zip(am, continuation)) if a != b)
    return f"transformers' greedy choice after {k} tokens is {am[k]}, the continuation has {continuation[k]}"


def hf_generate_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' own ``generate()``: n greedy tokens (end of sequence ignored)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()

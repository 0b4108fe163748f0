"""Text watermarking (Kirchenbauer et al., 2023, "A Watermark for Large Language Models").

Generation: before sampling, every token on the row's *green list* gets ``delta`` added
to its logit. The green list depends only on the previous token, as in TGI (its
``WatermarkLogitsProcessor``: seed = 15485863 * previous token), so a detector that sees
the text alone can recompute it.

A request's parameters are a ``sampling_params.Watermark``. Defaults: gamma 0.25, delta
2.0, those of the authors' reference implementation (TGI's are gamma 0.5, delta 2.0). At
128 tokens of the default model TGI's pair left 6.5% of watermarked texts under z = 4 and
gamma 0.25 left 3% (benchmarks/RESULTS.md): a smaller green list makes each green token
stronger evidence.

Detection: the fraction of green tokens in a text. Without the watermark each token is
green with probability ``gamma``, so with ``G`` green tokens out of ``T`` scored,
``z = (G - gamma T) / sqrt(T gamma (1 - gamma))`` and the one-sided p-value is
``P(N(0,1) >= z)``.

The green list. TGI draws a ``torch.randperm`` of the vocabulary per token, which a
device cannot afford per row per step (a sort of the vocabulary). Here token ``v`` is green
after token ``p`` iff ``h(p, v) < gamma * 2**32``, with ``h`` a keyed 32-bit hash (the
murmur3 finalizer on ``seed(p) ^ v * golden``): for a fixed ``p`` it is a bijection of
the token ids, so the list is a pseudo-random gamma-fraction of the vocabulary (its size
varies by a few tokens around ``gamma * V``, which the z-test does not need to know), it
costs a few integer operations per logit on the device, and the host detector computes the
same bits with numpy. The hash never depends on the vocabulary size.

Host and device share this module: the detector (numpy) and ``green_mask`` (jnp) call one
``_hash`` written over the array namespace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from jaxinfer.sampling_params import DEFAULT_GAMMA, Watermark

HASH_KEY = 15485863          # TGI's: a large prime, the previous token times it seeds the list
_GOLDEN = 0x9E3779B1          # spreads consecutive token ids over the 32-bit range
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35   # murmur3's fmix32 constants


def _fmix32(h: Any, xp: Any) -> Any:
    h = h ^ (h >> 16)
    h = h * xp.uint32(_M1)
    h = h ^ (h >> 13)
    h = h * xp.uint32(_M2)
    return h ^ (h >> 16)


def _hash(prev: Any, tokens: Any, xp: Any) -> Any:
    """u32 hashes of (previous token, token) pairs (broadcasting), in numpy or jax.numpy."""
    seed = _fmix32(prev.astype(xp.uint32) * xp.uint32(HASH_KEY), xp)
    return _fmix32(seed ^ (tokens.astype(xp.uint32) * xp.uint32(_GOLDEN)), xp)


def green_mask(prev: Any, vocab_size: int, threshold: Any) -> Any:
    """Device side: bool[B, V], token v green after prev[b] (prev i32[B], threshold u32[B])."""
    import jax.numpy as jnp
    from jax import lax

    v = lax.broadcasted_iota(jnp.uint32, (1, vocab_size), 1)
    return _hash(prev[:, None], v, jnp) < threshold[:, None]


def is_green(prev: Sequence[int] | np.ndarray, tokens: Sequence[int] | np.ndarray,
             gamma: float = DEFAULT_GAMMA) -> np.ndarray:
    """Host side: bool array, ``tokens[i]`` is on the green list of ``prev[i]``."""
    with np.errstate(over="ignore"):
        h = _hash(np.asarray(prev, np.int64) % 2**32, np.asarray(tokens, np.int64) % 2**32, np)
    return h < np.uint32(Watermark(gamma=gamma).threshold)


@dataclass(frozen=True, slots=True)
class Detection:
    z_score: float
    p_value: float            # one-sided: P(N(0, 1) >= z) for unwatermarked text
    num_scored: int           # tokens scored (distinct (previous, token) pairs by default)
    num_green: int
    green_fraction: float

    def as_dict(self) -> dict[str, float | int]:
        return {"z_score": self.z_score, "p_value": self.p_value, "num_scored": self.num_scored,
                "num_green": self.num_green, "green_fraction": self.green_fraction}


def z_score(num_green: int, num_scored: int, gamma: float) -> float:
    return (num_green - gamma * num_scored) / math.sqrt(num_scored * gamma * (1 - gamma))


def p_value(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2))


def detect(token_ids: Iterable[int], gamma: float = DEFAULT_GAMMA, *, ignore_repeated_bigrams: bool = True) -> Detection:
    """Score a token sequence: every token after the first is scored against the green list
    of the token before it. ``ignore_repeated_bigrams``: count each (previous, token) pair
    once, as Kirchenbauer et al.'s detector can: a text that repeats itself would otherwise
    count one green pair many times (the tokens are no longer independent trials)."""
    ids = [int(t) for t in token_ids]
    if any(t < 0 for t in ids):
        raise ValueError("token_ids: must be non-negative")
    pairs = list(zip(ids[:-1], ids[1:]))
    if ignore_repeated_bigrams:
        pairs = list(dict.fromkeys(pairs))
    if not pairs:
        raise ValueError("token_ids: need at least two tokens to score")
    prev, tok = (np.array(x, np.int64) for x in zip(*pairs))
    g = int(is_green(prev, tok, gamma).sum())
    z = z_score(g, len(pairs), gamma)
    return Detection(z, p_value(z), len(pairs), g, g / len(pairs))


def detect_text(text: str, tokenizer: Any, gamma: float = DEFAULT_GAMMA, *, ignore_repeated_bigrams: bool = True) -> Detection:
    """``detect`` on ``text`` tokenized without special tokens (the first token of a
    generated text has no known predecessor: it is not scored)."""
    if not text:
        raise ValueError("text: empty")
    ids = tokenizer.encode(text, add_special_tokens=False)
    return detect(ids, gamma, ignore_repeated_bigrams=ignore_repeated_bigrams)

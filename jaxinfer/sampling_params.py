"""A request's sampling parameters, ``SamplingParams``, and the host-only records two of its
fields parse to: ``GuidedDecoding`` (what the output must match) and ``Watermark``.

``SamplingParams`` never changes compiled shapes: the sampler receives its values as per-row
arrays, so any mix of requests shares one executable. Everything here is validated once,
with errors that name the offending field; what acts on it is the engine's
(engine/guided.py compiles the grammar, engine/watermark.py draws the green lists,
engine/sampler.py applies the rest). No jax, no grammar library.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from jaxinfer import untrusted_json
from jaxinfer.bounds import INT32_MAX, Bound, require

MAX_TEMPERATURE = 1e4             # beyond it every row is uniform anyway (float32 logits / t)
MAX_REPETITION_PENALTY = 1e4
MAX_LENGTH_PENALTY = 10.0

# ------------------------------------------------------------------ guided decoding

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024      # a schema / regex / grammar's text
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
MAX_LOGIT_BIAS = 300            # entries per request (the device width of the bias arrays)
MAX_BAD_WORDS = 64
MAX_SCHEMA_DEPTH = 64           # arrays/objects nested in a JSON schema


class GuidedDecodingError(ValueError):
    """A grammar the library refuses (invalid, unsupported feature, over a limit)."""


@dataclass(frozen=True, slots=True)
class GuidedDecoding:
    """What the output must match. ``kind`` is one of KINDS; ``value`` is the schema as
    canonical JSON text (json), None (json_object), the regex / grammar text, or the tuple
    of choices. Build with ``GuidedDecoding.parse`` from the API's shapes."""

    kind: str
    value: Any = None

    @staticmethod
    def parse(x: Any) -> "GuidedDecoding":
        """From a GuidedDecoding or a dict with one key: ``json`` (schema object or text),
        ``json_object`` (true), ``regex``, ``choice`` (list of strings), ``grammar``."""
        if isinstance(x, GuidedDecoding):
            return _checked(x.kind, x.value)
        if not isinstance(x, dict) or len(x) != 1:
            raise ValueError(f"guided: expected a dict with one of the keys {', '.join(KINDS)}, got {x!r:.80}")
        (kind, value), = x.items()
        if kind == "json":
            value = _schema_text(value)
        elif kind == "json_object":
            value = None
        elif kind == "choice" and isinstance(value, (list, tuple)):
            value = tuple(value)
        return _checked(kind, value)

    def cache_key(self) -> str:
        return json.dumps([self.kind, self.value])


def _schema_text(value: Any) -> str:
    """A schema (object or its JSON text, from a client) -> canonical text; refuses text the
    parser would choke on and nesting no schema needs (either would reach llguidance or
    json.dumps as a RecursionError)."""
    try:
        if isinstance(value, str):
            value = untrusted_json.loads(value, MAX_SCHEMA_DEPTH)
        elif isinstance(value, dict):
            untrusted_json.check_depth(value, MAX_SCHEMA_DEPTH)
    except untrusted_json.UntrustedJSONError as e:
        raise GuidedDecodingError(f"guided.json: the schema {e}") from None
    if not isinstance(value, (dict, bool)):
        raise GuidedDecodingError(f"guided.json: a schema must be an object, got {type(value).__name__}")
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _checked(kind: str, value: Any) -> GuidedDecoding:
    if kind not in KINDS:
        raise ValueError(f"guided: unknown kind {kind!r} (expected one of {', '.join(KINDS)})")
    if kind == "choice":
        if not isinstance(value, tuple) or not value:
            raise GuidedDecodingError("guided.choice: expected a non-empty list of strings")
        if len(value) > MAX_CHOICES:
            raise GuidedDecodingError(f"guided.choice: at most {MAX_CHOICES} choices, got {len(value)}")
        for c in value:
            if not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS:
                raise GuidedDecodingError(f"guided.choice: each choice must be a non-empty string of at "
                                          f"most {MAX_CHOICE_CHARS} characters, got {c!r:.80}")
    elif kind != "json_object":
        if not isinstance(value, str) or not value:
            raise GuidedDecodingError(f"guided.{kind}: expected a non-empty string")
        if len(value) > MAX_SPEC_CHARS:
            raise GuidedDecodingError(f"guided.{kind}: {len(value)} characters is over the limit of "
                                      f"{MAX_SPEC_CHARS}")
    return GuidedDecoding(kind, value)


# ------------------------------------------------------------------ watermark

MAX_DELTA = 100.0
DEFAULT_GAMMA, DEFAULT_DELTA = 0.25, 2.0     # the paper's reference implementation's (engine/watermark.py)


@dataclass(frozen=True, slots=True)
class Watermark:
    """Per-request watermark parameters (defaults: the paper's reference implementation);
    the green lists they draw are engine/watermark.py's."""

    gamma: float = DEFAULT_GAMMA      # fraction of the vocabulary on each green list
    delta: float = DEFAULT_DELTA      # logit bias added to green tokens

    def __post_init__(self) -> None:
        for name in ("gamma", "delta"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"watermark.{name}: must be a number, got {v!r}")
        if not 0 < self.gamma < 1:
            raise ValueError(f"watermark.gamma: must be in (0, 1), got {self.gamma!r}")
        if not 0 < self.delta <= MAX_DELTA:
            raise ValueError(f"watermark.delta: must be in (0, {MAX_DELTA:g}], got {self.delta!r}")

    @property
    def threshold(self) -> int:
        """Hashes below this are green: ``floor(gamma * 2**32)`` (host-computed for both
        the sampler's tensors and the detector, so both compare the same integer)."""
        return int(self.gamma * 2**32)

    @classmethod
    def parse(cls, value: Any) -> "Watermark | None":
        """``SamplingParams.watermark``: None / False (off), True (defaults), a dict with
        ``gamma`` / ``delta``, or a Watermark."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"gamma", "delta"}
            if unknown:
                raise ValueError(f"watermark: unknown field {sorted(unknown)[0]!r} (gamma, delta)")
            return cls(**value)
        raise ValueError(f"watermark: expected true/false or {{'gamma': ..., 'delta': ...}}, got {value!r:.80}")


# ------------------------------------------------------------------ the parameters

@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling parameters, named as in vLLM / the OpenAI API.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` disable those
    filters. Penalties follow vLLM: ``repetition_penalty`` (HF/CTRL style, divides positive
    logits of every token seen in prompt or output) and OpenAI's ``presence_penalty`` /
    ``frequency_penalty`` (subtracted, counting output tokens only). ``logprobs=k`` returns
    the chosen token's log-probability and the k most likely alternatives, computed from
    the model's raw distribution (before temperature and filters), as vLLM does.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Constrained decoding (jaxinfer/engine/guided.py): a GuidedDecoding or a dict with one
    # key (json / json_object / regex / choice / grammar); token id -> bias added to the
    # logit (a dict or (id, bias) pairs); EOS / stop ids banned for the first min_tokens;
    # strings whose token sequences may not be generated.
    guided: Any = None
    logit_bias: Any = ()
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    # Prefix caching (vLLM's cache_salt): requests share cached KV pages only with requests
    # of the same salt, so tenants who must not see each other's timing don't share.
    cache_salt: str | None = None
    # Scoring and search (engine/scoring.py, engine/beam.py, engine/watermark.py):
    # prompt_logprobs=k: every prompt token's logprob and the top k alternatives (vLLM);
    # with it max_tokens may be 0 (score the prompt, generate nothing). best_of: sample
    # that many, return the n with the highest cumulative logprob. beam_width > 1: beam
    # search (HF generate's num_beams), its n best hypotheses returned, ranked by
    # cumulative logprob / generated_length ** length_penalty; early_stopping True /
    # False / "never" as in HF. watermark: True, {"gamma": g, "delta": d} or a
    # Watermark.
    prompt_logprobs: int | None = None
    best_of: int | None = None
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    watermark: Any = None

    MAX_LOGPROBS = 20
    MAX_BEAM_WIDTH = 10        # 2 * width candidates per beam must fit the top-MAX_LOGPROBS
    MAX_CACHE_SALT_CHARS = 1024
    MAX_SAMPLES = 1024         # n / best_of: sequences of one request (the engine's max_num_seqs caps it too)
    # The numeric fields' ranges (Bound), each closed on both sides: every value reaches an
    # int32 / float32 device array or a float power, so an open end is a crash waiting for
    # a client (2**31 in top_k, 1e308 in length_penalty). min_tokens is also capped by
    # max_tokens, top_k by the vocabulary (Engine.add_request; the server when parsing).
    BOUNDS = {
        "n": Bound(True, 1, MAX_SAMPLES), "max_tokens": Bound(True, 1, INT32_MAX),
        "temperature": Bound(False, 0, MAX_TEMPERATURE, note="0: greedy"),
        "top_p": Bound(False, 0, 1, lo_open=True),
        "top_k": Bound(True, -1, INT32_MAX, note="0 or -1: disabled; at most the vocabulary size"),
        "min_p": Bound(False, 0, 1), "repetition_penalty": Bound(False, 0, MAX_REPETITION_PENALTY, lo_open=True),
        "presence_penalty": Bound(False, -2, 2), "frequency_penalty": Bound(False, -2, 2),
        "logprobs": Bound(True, 0, MAX_LOGPROBS), "min_tokens": Bound(True, 0, INT32_MAX),
        "prompt_logprobs": Bound(True, 0, MAX_LOGPROBS), "best_of": Bound(True, 1, MAX_SAMPLES),
        "beam_width": Bound(True, 1, MAX_BEAM_WIDTH, note="1: no beam search"),
        # generated_length ** length_penalty stays finite (and non-zero) for any length up
        # to 2**20 tokens; HF's and vLLM's defaults live in [0, 2]
        "length_penalty": Bound(False, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY),
        "seed": Bound(True, -2**63, 2**63 - 1, note="64 bits"),
    }
    _OPTIONAL = ("logprobs", "prompt_logprobs", "best_of", "seed")     # None: off

    @property
    def penalized(self) -> bool:
        """A repetition, presence or frequency penalty is set (the device keeps penalty
        state for the sequence)."""
        return self.repetition_penalty != 1 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    def __post_init__(self) -> None:
        # Accept lists / single strings for convenience but store tuples (hashable, frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for name, bound in self.BOUNDS.items():
            v = getattr(self, name)
            if name == "max_tokens" and v == 0 and self.prompt_logprobs is not None:
                continue                     # scoring only: the prompt's logprobs, no output
            if not (name in self._OPTIONAL and v is None):
                require(bound.ok(v), name, f"must be {bound.text()}, got {v!r:.80}")
        require(all(isinstance(s, str) and s for s in self.stop), "stop",
                f"must be non-empty strings, got {self.stop!r}")
        require(all(isinstance(t, int) and 0 <= t <= INT32_MAX for t in self.stop_token_ids), "stop_token_ids",
                f"must be token ids (integers in [0, {INT32_MAX}]), got {self.stop_token_ids!r:.80}")
        require(self.cache_salt is None or (isinstance(self.cache_salt, str)
                and 0 < len(self.cache_salt) <= self.MAX_CACHE_SALT_CHARS), "cache_salt",
                f"must be a non-empty string of at most {self.MAX_CACHE_SALT_CHARS} characters or None, "
                f"got {self.cache_salt!r:.80}")
        self._check_constraints()
        self._check_search()

    def _check_search(self) -> None:
        """prompt_logprobs, best_of, beam search, watermark, and the combinations not served."""
        object.__setattr__(self, "watermark", Watermark.parse(self.watermark))
        if self.max_tokens == 0:
            require(self.n == 1 and self.best_of is None and self.beam_width == 1, "max_tokens",
                    "0 (score the prompt only) takes n=1, no best_of and no beam search")
        if self.best_of is not None:
            require(self.best_of >= self.n, "best_of", f"must be >= n ({self.n}), got {self.best_of}")
            require(self.best_of == 1 or self.temperature > 0, "best_of",
                    "must be 1 with greedy sampling (temperature 0): every sample would be the same")
        require(self.early_stopping in (True, False, "never"), "early_stopping",
                f"must be true, false or \"never\", got {self.early_stopping!r}")
        if self.beam_width > 1:
            self._check_beam()

    def _check_beam(self) -> None:
        """Beam search is deterministic (HF's num_beams without do_sample) over the raw
        log-probabilities: options that would change them or need sampling are refused."""
        require(self.n <= self.beam_width, "n", f"must be <= beam_width={self.beam_width} with beam search, "
                f"got {self.n}")
        require(self.temperature == 0, "temperature", "must be 0 with beam search (it is deterministic)")
        for name, off in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("repetition_penalty", 1.0),
                          ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
            require(getattr(self, name) in (off, -1 if name == "top_k" else off), name,
                    "is not supported with beam search")
        for name in ("best_of", "logprobs", "watermark"):
            require(getattr(self, name) is None, name, "is not supported with beam search")
        require(not self.stop, "stop", "stop strings are not supported with beam search (stop_token_ids are)")
        require(not self.constrained, "guided", "guided decoding, logit_bias, min_tokens and bad_words are "
                "not supported with beam search")

    def _check_constraints(self) -> None:
        if self.guided is not None:
            object.__setattr__(self, "guided", GuidedDecoding.parse(self.guided))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((int(k), float(v)) for k, v in bias))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias: expected a map of token id -> number, got {self.logit_bias!r:.80}") from None
        require(len(bias) <= MAX_LOGIT_BIAS, "logit_bias",
                f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        require(all(i >= 0 and math.isfinite(v) and -100 <= v <= 100 for i, v in bias), "logit_bias",
                "token ids must be >= 0 and biases numbers in [-100, 100]")
        require(len({i for i, _ in bias}) == len(bias), "logit_bias", "a token id appears twice")
        object.__setattr__(self, "logit_bias", bias)
        require(self.min_tokens <= self.max_tokens, "min_tokens",
                f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words)
        require(len(words) <= MAX_BAD_WORDS and all(isinstance(w, str) and w.strip() for w in words),
                "bad_words", f"must be at most {MAX_BAD_WORDS} non-empty strings, got {self.bad_words!r:.80}")
        object.__setattr__(self, "bad_words", words)

    @property
    def constrained(self) -> bool:
        """Whether the sampler's token mask has work for this request."""
        return self.guided is not None or bool(self.logit_bias) or self.min_tokens > 0 or bool(self.bad_words)

    @property
    def needs_host_between_steps(self) -> bool:
        """A step of this request needs its previous token on the host: a token mask built
        from it (constrained), the watermark's green list seeded by it, a beam search's
        or a scoring request's step after the search (engine/search.py). The overlapped
        loop does not schedule such a sequence while its last token is in flight."""
        return self.constrained or self.watermark is not None or self.beam_width > 1 or self.max_tokens == 0

    def replace(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

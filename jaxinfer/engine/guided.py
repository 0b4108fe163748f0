"""Constrained decoding on the host: grammar state per sequence -> packed bitmask rows per step.

A request may carry a grammar (``SamplingParams.guided``: a JSON schema, any JSON object, a
regex, a list of choices or a Lark / GBNF grammar), a ``logit_bias``, ``min_tokens`` and
``bad_words``, parsed and bounded with the request (sampling_params.py: ``GuidedDecoding``).
Each becomes part of one per-row ``TokenMask`` that the sampler applies on the
device after penalties and before temperature (``sampler.apply_token_mask``):

* bits i32[S', ceil(V / 32)]: bit j of row i = token j allowed (llguidance's layout, so its
  matcher writes the grammar's mask straight into the row); min_tokens and bad words clear
  bits of the same row;
* bias_ids i32[S', MAX_LOGIT_BIAS] / bias_vals f32[S', ...]: added to the logits (0 = pad);
* active bool[S']: rows that have anything; a block of rows with none skips the whole hook
  on the device, and a step with no active row reuses one constant all-ones mask, so
  requests without constraints pay nothing but passing that array.

Library: llguidance. Measured on the default vocabulary (49,152 tokens, 2-core CPU, see
benchmarks/RESULTS.md): a mask costs tens of microseconds per token, like xgrammar, but
llguidance builds a grammar lazily in about a millisecond where xgrammar's compile took up
to a few hundred milliseconds per schema; and llguidance needs no torch / triton (xgrammar
depends on both), is a single Rust wheel, reports schema errors as readable messages, and
reads JSON schema, regex and Lark (plus GBNF via its converter) with one matcher type.

Host only, no jax import (like the scheduler): testable in milliseconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from jaxinfer.sampling_params import MAX_LOGIT_BIAS, GuidedDecoding, GuidedDecodingError

MAX_BAD_WORD_TOKENS = 16        # tokens of one bad word
GRAMMAR_CACHE_SIZE = 128        # compiled grammars kept, least recently used dropped first
GRAMMAR_COMPILE_SECONDS = 10.0  # a compile's time budget (queueing included); past it: refused
GRAMMAR_COMPILE_WORKERS = 2     # compiles at once, in threads off the engine's path
# Caps on what one grammar may cost the host (llguidance's own defaults are for trusted input):
# the size of the grammar a compile builds (symbols, lexer states, fuel for the lexer's first
# build), and the work of one mask in a step (lexer fuel ~14k/ms, Earley items ~20k/ms: under
# ~20 ms per constrained row). Past a step limit the matcher errs, allows only EOS,
# and the sequence stops (logged): one grammar cannot stall a step.
PARSER_LIMITS = dict(max_grammar_size=100_000, max_lexer_states=50_000, initial_lexer_fuel=1_000_000,
                     step_lexer_fuel=200_000, step_max_items=50_000, verbose_errors=False)
# Compact JSON (", " and ": " separators, no free whitespace): small models fed free
# whitespace tend to emit it forever; every output is still valid JSON.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(spec: GuidedDecoding) -> str:
    """The llguidance grammar for a spec (not yet validated against a tokenizer)."""
    from llguidance import LLMatcher, grammar_from

    try:
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if spec.kind == "json":
            return LLMatcher.grammar_from_json_schema(spec.value, overrides=JSON_OPTIONS)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            return grammar_from("choice", list(spec.value))
        return grammar_from("grammar", spec.value)          # Lark, or GBNF (converted)
    except (ValueError, TypeError) as e:
        raise GuidedDecodingError(f"guided.{spec.kind}: {e}") from None


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A grammar compiled for one tokenizer (GrammarCompiler.compile), keyed by its spec's
    ``cache_key``. Never consumes a token itself: ``matcher()`` gives each sequence a deep
    copy, which shares the lexer llguidance built lazily."""

    key: str
    template: Any

    def matcher(self) -> Any:
        return self.template.deep_copy()


class GrammarCompiler:
    """Grammars compiled for one tokenizer, off the caller's thread and within budgets.

    A compile runs in a pool of GRAMMAR_COMPILE_WORKERS threads (llguidance drops the GIL
    while it builds a grammar and computes a mask, so a compile in progress does not slow
    the engine thread's Python); the caller waits at most ``time_budget`` seconds (queueing
    included), then gets a GuidedDecodingError naming the budget. Size is bounded by
    llguidance's own limits (PARSER_LIMITS: symbols, lexer states, lexer fuel), whose errors
    name the limit. Results are cached by text (LRU of GRAMMAR_CACHE_SIZE); a compile that
    outlives its caller's budget still lands in the cache."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 time_budget: float = GRAMMAR_COMPILE_SECONDS):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.time_budget = time_budget
        self.compiled = 0
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()          # the cache: callers and pool threads share it
        self._library_lock = threading.Lock()
        self._library: tuple[Any, Any] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(GRAMMAR_COMPILE_WORKERS,
                                                           thread_name_prefix="jaxinfer-grammar")

    def submit(self, spec: GuidedDecoding) -> concurrent.futures.Future:
        """The compiled grammar as a future: already done for a cached text, else compiling
        in the pool. Raises nothing itself; the future holds any GuidedDecodingError."""
        hit = self._cached(spec.cache_key())
        if hit is not None:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(hit)
            return done
        return self._pool.submit(self._compile_cached, spec)

    def compile(self, spec: GuidedDecoding) -> CompiledGrammar:
        """Blocks up to ``time_budget`` (the compile itself runs in the pool)."""
        future = self.submit(spec)
        try:
            return future.result(timeout=self.time_budget)
        except concurrent.futures.TimeoutError:
            future.cancel()                    # if it is still queued: nobody waits for it
            raise self._over_time(spec) from None

    async def compile_async(self, spec: GuidedDecoding) -> CompiledGrammar:
        """``compile`` for an event loop: awaits the pool without holding a thread."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self.submit(spec)), self.time_budget)
        except asyncio.TimeoutError:
            raise self._over_time(spec) from None

    def matcher(self, spec: GuidedDecoding) -> Any:
        """A fresh matcher for one sequence (``compile``, then a copy of its template)."""
        return self.compile(spec).matcher()

    def _over_time(self, spec: GuidedDecoding) -> GuidedDecodingError:
        return GuidedDecodingError(f"guided.{spec.kind}: the grammar did not compile within the time budget "
                                   f"of {self.time_budget:g} s")

    def _cached(self, key: str) -> CompiledGrammar | None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def _compile_cached(self, spec: GuidedDecoding) -> CompiledGrammar:
        key = spec.cache_key()
        hit = self._cached(key)               # queued behind a compile of the same text
        if hit is not None:
            return hit
        out = CompiledGrammar(key, self._build(spec))
        with self._lock:
            self.compiled += 1
            self._cache[key] = out
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return out

    def _build(self, spec: GuidedDecoding) -> Any:
        """spec -> a matcher template that has computed its first mask (when llguidance
        builds the lexer: here, not in the first step that samples for the request)."""
        from llguidance import LLMatcher

        lltok, limits = self._tokenizer_and_limits()
        m = LLMatcher(lltok, grammar_text(spec), log_level=0, limits=limits)   # errors: m.is_error()
        if not m.is_error():
            scratch = np.zeros(mask_width(self.vocab_size), np.int32)
            m.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        if m.is_error():
            raise GuidedDecodingError(f"guided.{spec.kind}: {m.get_error()}")
        return m

    def _tokenizer_and_limits(self) -> tuple[Any, Any]:
        """llguidance's view of the tokenizer, built on the first compile (in the pool: it
        takes ~0.6-2 s on the default vocabulary and holds the GIL meanwhile)."""
        with self._library_lock:
            if self._library is None:
                import llguidance
                import llguidance.hf

                lltok = llguidance.hf.from_tokenizer(self.tokenizer.hf, n_vocab=self.vocab_size,
                                                     eos_token=self.eos_token_ids or None)
                self._library = (lltok, llguidance.LLParserLimits(**PARSER_LIMITS))
            return self._library


# ------------------------------------------------------------------ per-sequence state

class SequenceConstraints:
    """One sequence's constraints: its grammar matcher (or None), min_tokens over the stop
    ids, bad-word token sequences and its logit bias."""

    def __init__(self, matcher: Any, min_tokens: int, min_tokens_ids: Sequence[int],
                 bad_words: Sequence[tuple[int, ...]], bias: Sequence[tuple[int, float]]):
        self.matcher = matcher
        self.min_tokens = min_tokens
        self.min_tokens_ids = np.asarray(sorted(set(min_tokens_ids)), np.int64)
        self.bad_words = list(bad_words)
        self.bias_ids = np.asarray([i for i, _ in bias], np.int32)
        self.bias_vals = np.asarray([v for _, v in bias], np.float32)
        self.stopped = False          # the grammar took its last token (or failed)
        self.error: str | None = None

    @property
    def needs_bits(self) -> bool:
        return self.matcher is not None or self.min_tokens > 0 or bool(self.bad_words)

    def fill(self, row: np.ndarray, output_ids: Sequence[int]) -> None:
        """Write this step's allowed-token bits into ``row`` (i32[W], starts all ones)."""
        if self.matcher is not None and not self.stopped:
            self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            if self.error is None and self.matcher.is_error():
                # over a step limit (PARSER_LIMITS): the row allows only EOS, so the
                # sequence ends on its next token; keep the reason for the log
                self.error = self.matcher.get_error()
        grammar_row = row.copy() if self.matcher is not None else None
        if len(output_ids) < self.min_tokens:
            _clear(row, self.min_tokens_ids)
        for words in self.bad_words:
            n = len(words)
            if n == 1 or (len(output_ids) >= n - 1 and tuple(output_ids[len(output_ids) - n + 1:]) == words[:-1]):
                _clear(row, np.asarray(words[-1:], np.int64))
        if grammar_row is not None and not row.any():
            # min_tokens / bad words left nothing the grammar allows: the grammar wins,
            # so the row never becomes all -inf.
            row[:] = grammar_row

    def valid_prefix(self, draft: Sequence[int]) -> int:
        """How many leading tokens of a speculative draft the grammar allows, up to and
        including one that completes it (the sequence ends there); the matcher's state is
        left as it was. Without a grammar, all: min_tokens, bad words and the bias only
        mask tokens, which the target then never samples, so such a draft token is
        rejected like any other."""
        m = self.matcher
        if m is None:
            return len(draft)
        if self.stopped or not draft:
            return 0
        n = m.validate_tokens(list(map(int, draft)))
        consumed = 0
        while consumed < n:     # cut after a token that completes the grammar
            m.consume_token(int(draft[consumed]))
            consumed += 1
            if m.is_stopped():
                break
        if consumed:
            m.rollback(consumed)
        return consumed

    def fill_run(self, rows: np.ndarray, output_ids: Sequence[int], draft: Sequence[int]) -> None:
        """Speculative verification: ``rows[j]`` (i32[1 + len(draft), W], all ones) gets the
        bits plain decoding would use after ``draft[:j]`` were emitted (``draft``: a
        ``valid_prefix``); the matcher's state is left as it was."""
        out = list(output_ids)
        consumed = 0
        for j in range(len(draft) + 1):
            if consumed and self.matcher.is_stopped():
                break       # draft[j - 1] completes the grammar: the sequence ends there
            self.fill(rows[j], out)
            if j < len(draft):
                out.append(int(draft[j]))
                if self.matcher is not None and not self.stopped:
                    self.matcher.consume_token(int(draft[j]))
                    consumed += 1
        if consumed:
            self.matcher.rollback(consumed)

    def advance(self, token: int) -> None:
        """Feed the sampled token to the matcher; a token it refuses ends the sequence."""
        if self.matcher is None or self.stopped:
            return
        if not self.matcher.consume_token(int(token)):
            self.error = self.matcher.get_error() or f"token {token} refused by the grammar"
            self.stopped = True
        elif self.matcher.is_stopped():
            self.stopped = True


def _clear(row: np.ndarray, ids: np.ndarray) -> None:
    ids = ids[(ids >= 0) & (ids < row.size * 32)]
    if ids.size:
        u = row.view(np.uint32)
        np.bitwise_and.at(u, ids // 32, ~(np.uint32(1) << (ids % 32).astype(np.uint32)))


def bad_word_sequences(tokenizer: Any, words: Iterable[str]) -> list[tuple[int, ...]]:
    """Token sequences for each bad word, as vLLM: the word as written and with a leading
    space (the form it takes mid-sentence); duplicates dropped."""
    out: list[tuple[int, ...]] = []
    for w in words:
        for text in (w, " " + w.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if not ids:
                continue
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise ValueError(f"bad_words: {w!r:.40} is {len(ids)} tokens, over the limit of "
                                 f"{MAX_BAD_WORD_TOKENS}")
            if ids not in out:
                out.append(ids)
    return out


# ------------------------------------------------------------------ the step's mask

@dataclass(frozen=True)
class TokenMaskArrays:
    """Host arrays of one step's TokenMask (see the module doc); numpy."""

    bits: np.ndarray        # i32[S', W]
    bias_ids: np.ndarray    # i32[S', MAX_LOGIT_BIAS]
    bias_vals: np.ndarray   # f32[S', MAX_LOGIT_BIAS]
    active: np.ndarray      # bool[S']


def mask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def empty_mask(rows: int, vocab_size: int) -> TokenMaskArrays:
    """The all-allowed, zero-bias mask of ``rows`` rows."""
    return TokenMaskArrays(np.full((rows, mask_width(vocab_size)), -1, np.int32),
                           np.zeros((rows, MAX_LOGIT_BIAS), np.int32),
                           np.zeros((rows, MAX_LOGIT_BIAS), np.float32),
                           np.zeros(rows, bool))


def build_mask(rows: int, vocab_size: int,
               entries: Sequence[tuple[int, SequenceConstraints, Sequence[int], Sequence[int]]]) -> TokenMaskArrays:
    """The step's mask: ``entries`` are (sampler slot, constraints, output token ids so far,
    speculative draft) of the rows that have constraints (every other row stays
    all-allowed, bias 0). A draft's slots follow its first: slot + j is masked as after
    ``draft[:j]`` (SequenceConstraints.fill_run)."""
    m = empty_mask(rows, vocab_size)
    tail = mask_width(vocab_size) * 32 - vocab_size
    for slot, c, out_ids, draft in entries:
        run = slice(slot, slot + 1 + len(draft))
        m.active[run] = True
        if c.needs_bits:
            if draft:
                c.fill_run(m.bits[run], out_ids, draft)
            else:
                c.fill(m.bits[slot], out_ids)
            if tail:             # ids past the vocabulary never exist
                m.bits[run, -1] &= np.int32(np.uint32((1 << (32 - tail)) - 1).view(np.int32))
        n = c.bias_ids.size
        m.bias_ids[run, :n] = c.bias_ids
        m.bias_vals[run, :n] = c.bias_vals
    return m

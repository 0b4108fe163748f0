"""The batch builder: the ONLY place that pads. A scheduled step -> every host array of
the step (``build_step``), fixed-shape numpy: the model's inputs, the sampler's rows and the
builder of the token mask.

Layout of a step (what the compiled step and the attention expect):

* ``num_decode`` decode slots first: one query token each (token i belongs to slot i). Any
  sequence with exactly one token to compute goes here, whether it is decoding or ends a
  prefill with a 1-token chunk.
* then ``num_prefill`` prefill slots of ``prefill_chunk`` token positions each: slot j owns
  tokens ``[num_decode + j*prefill_chunk, num_decode + (j+1)*prefill_chunk)`` and uses the
  first ``q_len`` of them.
* ``max_pages`` page-table columns per slot.
* ``sample_rows`` sampler rows (S' >= the slots): row i samples slot i's logits.

A prefill chunk longer than the bucket's ``prefill_chunk`` fills several consecutive slots,
one piece each (piece i: the chunk's tokens ``[i*prefill_chunk, (i+1)*prefill_chunk)``,
its KV length ending with them). That changes nothing for the attention: this step's K/V
are written into the pages before any slot attends, so a later piece sees the earlier
ones' keys as cached context, and a token's bits do not depend on how its prompt was cut.
So one shape (n, c) holds any set of chunks that needs at most n pieces: several prompts
share a step (vLLM's packed prefill) with at most c - 1 padding positions each. Only the
last piece of a chunk samples; the other pieces' sampler rows are ignored.

A ``Bucket`` is those four numbers; each bucket is one ahead-of-time compiled executable.
With ``score`` set (prompt logprobs, engine/scoring.py), its executable also computes the
logits of every token position and scores each against ``score_targets``; only prefill
buckets have such twins (``BucketLadders.score``), and a step uses one only when one of
its chunks asks for prompt logprobs (a 1-token chunk that does then rides in a prefill
slot, so the twin always exists).

Padding: every array has its bucket's shape, and what no entry fills is padding, inert by
construction. A padding token is token 0 at position 0, written into page 0 (the sink; token
i at offset i % page_size), with penalty-state row PAD_ROW (a sink too), LoRA slot 0 (none)
and no score (score_k -1); a padding slot has no query and no KV (q_len = kv_len = 0) and a
page table of page 0. A sampler row no sampled slot fills is greedy without logprobs
(sampler.PAD_TEMPERATURE) and allows every token (guided.empty_mask); past the slots its
penalty-state row is PAD_ROW. Every array starts as its padding (``padded_arrays``,
``sampler.sampling_tensors_from_params``, ``guided.build_mask``) and the entries are written
over it.

Host only: numpy; nothing here calls jax (a step is built while the device may still run
the last one).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence as Seq

import numpy as np

from jaxinfer.engine import guided as G
from jaxinfer.engine import sampler as S
from jaxinfer.engine.scheduler import ScheduledSeq

PAD_ROW = 0   # penalty-state row of padding slots (a sink, like KV page 0)


@dataclass(frozen=True, slots=True, order=True)
class Bucket:
    num_tokens: int           # = num_decode + num_prefill * prefill_chunk (sort key first)
    max_pages: int
    num_decode: int
    num_prefill: int
    prefill_chunk: int
    score: bool = False       # also scores every token position (prompt logprobs)
    min_sample_rows: int = 1  # the sampler sees at least this many rows (BucketLadders)

    @classmethod
    def of(cls, num_decode: int, num_prefill: int, prefill_chunk: int, max_pages: int,
           score: bool = False, min_sample_rows: int = 1) -> "Bucket":
        return cls(num_decode + num_prefill * prefill_chunk, max_pages, num_decode,
                   num_prefill, prefill_chunk, score, min_sample_rows)

    @property
    def num_seqs(self) -> int:
        return self.num_decode + self.num_prefill

    @property
    def natural_sample_rows(self) -> int:
        """num_seqs rounded up to a power of two."""
        return 1 << (self.num_seqs - 1).bit_length()

    @property
    def sample_rows(self) -> int:
        """Rows the sampler sees: num_seqs rounded up to a power of two, so the sampler
        (slow to compile) has a handful of executables, not one per bucket, and at least
        ``min_sample_rows`` (the ladder's default: the widest, so one sampler serves all)."""
        return max(self.natural_sample_rows, self.min_sample_rows)


@dataclass(frozen=True, slots=True)
class BucketLadders:
    """Sorted ladders; every combination below is compiled at start-up.

    ``decode_sizes`` serve decode-only steps; ``mixed_decode_sizes`` (coarser, 0 included)
    serve steps that also carry prefill chunks, whose cost the prefill dominates.
    ``prefill_shapes`` are (num_prefill, prefill_chunk) pairs: a shape holds any set of
    chunks whose pieces (``pieces``) number at most ``num_prefill``. ``score``: every
    bucket with prefill slots also gets its scoring twin (``Bucket.score``).
    ``min_sample_rows``: every bucket's sampler sees at least this many rows
    (EngineConfig.min_sampler_rows): fewer sampler executables, each step samples the
    padding. None: the widest any bucket needs, so one sampler serves every bucket.
    """

    decode_sizes: tuple[int, ...]
    mixed_decode_sizes: tuple[int, ...]
    prefill_shapes: tuple[tuple[int, int], ...]
    page_sizes: tuple[int, ...]
    score: bool = False
    min_sample_rows: int | None = 1

    def __post_init__(self) -> None:
        for name in ("decode_sizes", "mixed_decode_sizes", "prefill_shapes", "page_sizes"):
            v = getattr(self, name)
            if not v or list(v) != sorted(set(v)):
                raise ValueError(f"{name}: must be a non-empty sorted ladder without repeats, got {v!r}")
        if self.min_sample_rows is None:      # the widest bucket's rows (its num_seqs, rounded up)
            seqs = max(self.decode_sizes + tuple(d + n for d in self.mixed_decode_sizes
                                                 for n, _ in self.prefill_shapes))
            object.__setattr__(self, "min_sample_rows", 1 << (seqs - 1).bit_length())

    def all_buckets(self) -> list[Bucket]:
        m = self.min_sample_rows
        out = {Bucket.of(d, 0, 0, p, False, m) for d, p in itertools.product(self.decode_sizes, self.page_sizes)
               if d > 0}
        out |= {Bucket.of(d, n, c, p, score, m) for d, (n, c), p in
                itertools.product(self.mixed_decode_sizes, self.prefill_shapes, self.page_sizes)
                for score in ((False, True) if self.score else (False,))}
        return sorted(out)

    def choose(self, num_decode: int, chunks: Seq[int], max_pages: int,
               ready: Callable[[Bucket], bool] | None = None, score: bool = False) -> Bucket:
        """The cheapest bucket holding the step (fewest token positions, then fewest
        slots), or ValueError (a scheduler bug). ``ready``: while buckets still compile in
        the background, the cheapest compiled bucket that holds the step instead (the
        tokens do not depend on the bucket: batch invariance); the ideal one when none
        is compiled yet (the caller then waits for it). ``score``: a scoring twin (the
        step has prefill chunks that want prompt logprobs)."""
        if score and not (self.score and chunks):
            raise ValueError("prompt_logprobs: this engine has no scoring buckets "
                             "(EngineConfig.enable_prompt_logprobs)" if not self.score else
                             "a scoring step needs a prefill chunk")
        best = self._choose(num_decode, chunks, max_pages)
        best = dataclasses.replace(best, score=score) if score else best
        if ready is None or ready(best):
            return best
        fits = [b for b in self.all_buckets()
                if b.score == score and ready(b) and holds(b, num_decode, chunks, max_pages)]
        return min(fits, key=lambda b: (b.num_tokens, b.num_seqs), default=best)

    def _choose(self, num_decode: int, chunks: Seq[int], max_pages: int) -> Bucket:
        pages = _ceil_in(self.page_sizes, max_pages, "pages per sequence")
        if not chunks:
            if num_decode <= self.decode_sizes[-1]:
                return Bucket.of(_ceil_in(self.decode_sizes, num_decode, "decode slots"), 0, 0, pages,
                                 False, self.min_sample_rows)
        best = None
        for n, c in self.prefill_shapes:
            if pieces(chunks, c) <= n and (best is None or (n * c, n) < (best[0] * best[1], best[0])):
                best = (n, c)
        if best is None:
            raise ValueError(f"no bucket holds {len(chunks)} prefill chunks of {sum(chunks)} tokens "
                             f"(up to {max(chunks)} each)")
        d = _ceil_in(self.mixed_decode_sizes, num_decode, "decode slots")
        return Bucket.of(d, best[0], best[1], pages, False, self.min_sample_rows)


def holds(b: Bucket, num_decode: int, chunks: Seq[int], max_pages: int) -> bool:
    """Bucket ``b`` can carry a step of ``num_decode`` decodes and these prefill chunks
    (unused slots are padding, as in any step that does not fill its bucket)."""
    if b.max_pages < max_pages or b.num_decode < num_decode:
        return False
    if not chunks:
        return True
    return b.num_prefill > 0 and pieces(chunks, b.prefill_chunk) <= b.num_prefill


def pieces(chunks: Seq[int], chunk: int) -> int:
    """Prefill slots of ``chunk`` positions that ``chunks`` fill (each is cut in pieces)."""
    return sum(-(-n // chunk) for n in chunks)


def _ceil_in(ladder: Seq[int], n: int, what: str) -> int:
    for v in ladder:
        if v >= n:
            return v
    raise ValueError(f"{what}: {n} exceeds the largest bucket ({ladder[-1]})")


def default_ladders(max_num_seqs: int, max_model_len: int, page_size: int,
                    max_num_batched_tokens: int) -> BucketLadders:
    """Powers of two for decode up to max_num_seqs; a coarser ladder when prefill rides
    along; prefill regions of 1, 2, 4, 8, ... slots of 32 positions up to the token budget
    (at most 512), which pack several prompts, or the pieces of one, into a step: a chunk
    pads to at most twice its length (plus 31), and one prompt cut into slots runs as fast
    as in a single slot of the same size (benchmarks/RESULTS.md, "Prefill shapes"). Two
    slots (64 positions) serve the short remainders a prefix-cache hit leaves (a chat's new
    turn). With max_num_seqs 1, single slots of 32, 64, 128, 256 positions and the budget
    instead: the sampler is as wide as the widest bucket's sequences, and a one-sequence
    engine keeps it one row.

    One page-table width: the attention loops over KV blocks up to the longest live
    sequence at run time, so a wider table costs only its int32 entries, not compute.
    """
    decode = sorted({min(1 << i, max_num_seqs) for i in range(max_num_seqs.bit_length() + 1)})
    if max_num_seqs == 1:
        mixed = [0]                     # one sequence: prefilling means nothing decodes
    else:
        mixed = sorted({0, min(8, max_num_seqs), max_num_seqs} | ({32} if max_num_seqs > 32 else set()))
    big = max(32, min(512, max_num_batched_tokens))
    if max_num_seqs == 1:
        shapes = {(1, 32 << i) for i in range(5) if 32 << i < big} | {(1, big)}
    else:
        slots = -(-big // 32)
        shapes = {(1 << i, 32) for i in range(slots.bit_length()) if 1 << i < slots} | {(slots, 32)}
    full = -(-max_model_len // page_size)
    return BucketLadders(tuple(decode), tuple(mixed), tuple(sorted(shapes)), (full,))


@dataclass
class StepBatch:
    """Every host array of one step, in its bucket's fixed shapes (``build_step``), plus
    the map back to sequences: the model's inputs (``STEP_ARRAYS``), the sampler's rows
    and the builder of the step's token mask."""

    bucket: Bucket
    tokens: np.ndarray          # i32[T]
    positions: np.ndarray       # i32[T]
    slot_mapping: np.ndarray    # i32[T]  page * page_size + offset (padding -> page 0)
    kv_lens: np.ndarray         # i32[S]  KV length after this step's tokens are written
    q_lens: np.ndarray          # i32[S]
    page_table: np.ndarray      # i32[S, P]
    logits_index: np.ndarray    # i32[S]  each slot's last token in the flat T axis
    rows: np.ndarray            # i32[S]  penalty-state row of each slot (PAD_ROW for padding)
    reset_rows: np.ndarray      # bool[S] the slot starts a (re)computation: clear its row
    token_rows: np.ndarray      # i32[T]  penalty-state row of each token
    token_is_output: np.ndarray  # bool[T] token is a generated one (else prompt / padding)
    lora_slots: np.ndarray      # i32[T]  device LoRA slot of each token's adapter (0: none / padding)
    # Scoring buckets (prompt logprobs): the token each position is scored against (the
    # next prompt token) and its top-k width (-1: not scored); ``scored`` maps rows back:
    # (entry, first row in T, first position, count) per run of scored positions.
    score_targets: np.ndarray   # i32[T]
    score_k: np.ndarray         # i32[T]
    # The overlapped loop: the penalty-state row whose kept token (the one the step in
    # flight samples) a position is fed, on the device (runner.feed_kept); -1: ``tokens``.
    feed_rows: np.ndarray       # i32[T]
    # The sampler's S' rows (Bucket.sample_rows): row i samples slot i's logits.
    sample_rows: np.ndarray     # i32[S'] penalty-state row of each sampler row
    # i32[S'] the penalty-state row under which each sampler row's token is kept on the
    # device for the next step to feed (runner.last_tokens; -1: not kept)
    keep_rows: np.ndarray
    sampling: Any               # sampler.SamplingTensors of S' rows (numpy)
    entries: list[tuple[int, ScheduledSeq]] = field(default_factory=list)   # (slot, entry)
    scored: list[tuple[ScheduledSeq, int, int, int]] = field(default_factory=list)
    # Builds the step's sampler.TokenMask (guided.build_mask) when called; None: no sampled
    # row is constrained (those steps pay nothing). The runner calls it once the forward
    # is enqueued, so the host computes grammar masks while the device runs.
    token_mask: Callable[[], Any] | None = None


def build_step(scheduled: Seq[ScheduledSeq], ladders: BucketLadders, page_size: int,
               rows_of: dict[int, int], lookahead: int = 0,
               ready: Callable[[Bucket], bool] | None = None,
               lora_slot_of: dict[int, int] | None = None,
               requests: Mapping[str, Any] | None = None, vocab_size: int = 0) -> StepBatch:
    """Every host array of the step that runs ``scheduled`` (the module doc: layout, padding).
    ``rows_of``: seq_id -> penalty-state row (1..max_num_seqs) of each running sequence.
    ``lora_slot_of``: Sequence.lora_id -> its adapter's device slot (engine/lora.py); every
    sequence of the step with a lora_id must be in it.
    ``lookahead``: the page table also covers this many positions past each chunk (a
    multi-step decode writes them on the device; their pages are already allocated, except
    past a draft model's own proposals: engine/spec_draft.py).
    ``ready``: which buckets are compiled, while some still compile (BucketLadders.choose).
    ``requests``: request id -> output.RequestState, whose seeds and constraints the sampler
    rows take; None: every sampler row is padding (a draft model's steps take argmax
    tokens). ``vocab_size``: the model's (the token mask's width)."""
    decodes, prefills = _slot_kinds(scheduled)
    max_pages = max(-(-(e.start_pos + e.num_new_tokens + lookahead) // page_size) for e in scheduled)
    b = ladders.choose(sum(e.num_new_tokens for e in decodes), [e.num_new_tokens for e in prefills],
                       max_pages, ready, any(map(wants_scores, scheduled)))
    w = _SlotWriter(b, page_size, rows_of, lookahead, lora_slot_of)
    # A speculating sequence takes 1 + len(draft) consecutive decode slots: slot j feeds
    # the token at start_pos + j (the last sampled one, then the draft) and attends to the
    # KV this step writes before it, so each slot's logits verify the next draft token.
    slot = 0
    for e in decodes:
        pages = np.asarray(e.seq.page_ids, np.int32)
        for j, tok in enumerate((None,) + e.draft):
            w.place(slot, slot, e, pages, e.start_pos + j, 1, j == 0, tok)
            slot += 1
    slot, c = b.num_decode, b.prefill_chunk
    for e in prefills:
        pages, end = np.asarray(e.seq.page_ids, np.int32), e.start_pos + e.num_new_tokens
        for start in range(e.start_pos, end, c):
            n = min(c, end - start)
            w.place(slot, b.num_decode + (slot - b.num_decode) * c, e, pages, start, n, start + n == end)
            slot += 1
    sample_rows = np.full(b.sample_rows, PAD_ROW, np.int32)
    sample_rows[:b.num_seqs] = w.arrays["rows"]
    keep_rows = np.full(b.sample_rows, -1, np.int32)
    for slot, e in w.entries:
        if e.samples and not e.draft:
            keep_rows[slot] = rows_of[e.seq.seq_id]
    return StepBatch(b, **w.arrays, sample_rows=sample_rows, keep_rows=keep_rows,
                     sampling=sampling_rows(b.sample_rows, w.entries, requests),
                     entries=w.entries, scored=w.scored,
                     token_mask=token_mask(b.sample_rows, w.entries, requests, vocab_size))


def _slot_kinds(scheduled: Seq[ScheduledSeq]) -> tuple[list[ScheduledSeq], list[ScheduledSeq]]:
    """(decode slot entries, prefill slot entries): one query token, or a draft, decodes;
    a 1-token chunk that wants scores takes a prefill slot (only prefill buckets score)."""
    decodes = [e for e in scheduled if (e.num_new_tokens == 1 and not wants_scores(e)) or e.draft]
    prefills = [e for e in scheduled if (e.num_new_tokens > 1 or wants_scores(e)) and not e.draft]
    return decodes, prefills


def padded_arrays(b: Bucket, page_size: int) -> dict[str, np.ndarray]:
    """The model's inputs (STEP_ARRAYS) of a step in bucket ``b``, all padding."""
    a = {k: np.zeros(shape, dt) for k, (shape, dt) in step_array_shapes(b).items()}
    a["slot_mapping"] += np.arange(b.num_tokens, dtype=np.int32) % page_size
    a["rows"][:] = a["token_rows"][:] = PAD_ROW
    a["score_k"][:] = a["feed_rows"][:] = -1
    return a


class _SlotWriter:
    """Writes a step's entries over its padded arrays, one slot at a time (``place``), and
    keeps the map back: ``entries`` (slot, entry) and ``scored`` (StepBatch.scored)."""

    def __init__(self, b: Bucket, page_size: int, rows_of: dict[int, int], lookahead: int,
                 lora_slot_of: dict[int, int] | None):
        self.arrays = padded_arrays(b, page_size)
        self.page_size, self.rows_of = page_size, rows_of
        self.lookahead, self.lora_slot_of = lookahead, lora_slot_of
        self.entries: list[tuple[int, ScheduledSeq]] = []
        self.scored: list[tuple[ScheduledSeq, int, int, int]] = []

    def place(self, slot: int, first_token: int, e: ScheduledSeq, pages: np.ndarray, start: int, n: int,
              last: bool, token: int | None = None) -> None:
        """Tokens [start, start + n) of ``e`` (all of it, or one piece) into ``slot``;
        ``pages``: the sequence's page ids as i32 (converted once per entry); ``token``:
        a draft token fed at ``start`` (n = 1) instead of the sequence's own."""
        a, seq, page_size = self.arrays, e.seq, self.page_size
        end = start + n
        sl = slice(first_token, first_token + n)
        row = self.rows_of[seq.seq_id]
        if token is not None:
            a["tokens"][sl] = token
        elif end <= seq.num_known_tokens:
            a["tokens"][sl] = seq.token_ids_slice(start, end)
        else:
            self._feed_pending(seq, first_token, start, end, row)
        pos = np.arange(start, end, dtype=np.int32)
        a["positions"][sl] = pos
        a["slot_mapping"][sl] = pages[pos // page_size] * page_size + pos % page_size
        # a draft token is not counted (it may be rejected; engine/speculative.py)
        a["token_rows"][sl] = row if token is None else PAD_ROW
        a["token_is_output"][sl] = pos >= seq.num_prompt_tokens
        if seq.lora_id:
            a["lora_slots"][sl] = self.lora_slot_of[seq.lora_id]
        a["kv_lens"][slot], a["q_lens"][slot] = end, n
        # (a draft model's multi-step decode may look further ahead than a row's pages:
        # those positions map to page 0, the sink)
        covered = pages[:-(-(end + self.lookahead) // page_size)]
        a["page_table"][slot, :len(covered)] = covered
        a["logits_index"][slot] = first_token + n - 1
        a["rows"][slot] = row
        a["reset_rows"][slot] = start == 0     # the penalty row is cleared before any token is added
        if last:
            self.entries.append((slot, e))
        self._score(e, first_token, start, end)

    def _feed_pending(self, seq: Any, first_token: int, start: int, end: int, row: int) -> None:
        """Tokens [start, end) of which the last is still on the device (the overlapped
        loop: sampled by the step in flight): the host ones as usual, the last fed on the
        device from the sequence's row of the runner's kept tokens (``feed_rows``)."""
        known = seq.num_known_tokens
        if end - known != 1 or seq.num_pending != 1:
            raise RuntimeError(f"batch: {seq!r} scheduled {end - known} tokens past its known ones "
                               f"({seq.num_pending} pending): only the last may be in flight")
        self.arrays["tokens"][first_token:first_token + known - start] = seq.token_ids_slice(start, known)
        self.arrays["feed_rows"][first_token + known - start] = row

    def _score(self, e: ScheduledSeq, first_token: int, start: int, end: int) -> None:
        """Position p is scored against prompt token p + 1 (the prompt's last position
        predicts the first output token: that is the sampler's row, not a score)."""
        seq, k = e.seq, e.seq.params.prompt_logprobs
        n_scored = min(end, seq.num_prompt_tokens - 1) - start
        if k is not None and n_scored > 0:
            span = slice(first_token, first_token + n_scored)
            self.arrays["score_targets"][span] = seq.prompt_token_ids[start + 1:start + 1 + n_scored]
            self.arrays["score_k"][span] = k
            self.scored.append((e, first_token, start, n_scored))


def sampling_rows(n: int, entries: Seq[tuple[int, ScheduledSeq]],
                  requests: Mapping[str, Any] | None) -> S.SamplingTensors:
    """The sampler's parameters of the step's ``n`` rows: each entry's sequence from its
    slot on (a draft's slots sample output tokens j ahead, each after the token it feeds),
    padding elsewhere; all padding without ``requests``. Takes the sequences' uncounted
    tokens (``counts_add``: this step folds them into the penalty state)."""
    if requests is None:
        return S.sampling_tensors_from_params([], [], [], n)
    params: list[Any] = [None] * n          # SamplingParams, None: padding
    seeds, steps, prev = [0] * n, [0] * n, [0] * n
    draft_before, counts_add = {}, {}       # penalties under speculation (engine/speculative.py)
    for slot, e in entries:
        seed = requests[e.seq.request_id].seeds[e.seq.sample_index]
        end = e.start_pos + e.num_new_tokens - len(e.draft)
        # a pending last token (the overlapped loop) is fed on the device: only the
        # watermark reads it here, and its requests wait for it (needs_host_between_steps)
        last = e.seq.token_ids_slice(end - 1, end) if end <= e.seq.num_known_tokens else [0]
        for j, fed in enumerate(last + list(e.draft)):
            params[slot + j], seeds[slot + j] = e.seq.params, seed
            steps[slot + j] = e.seq.num_output_tokens + e.seq.num_pending + j
            prev[slot + j] = fed               # the watermark's green list follows it
            if j and e.seq.params.penalized:
                draft_before[slot + j] = e.draft[:j]
        if e.seq.uncounted_tokens:
            counts_add[slot] = e.seq.uncounted_tokens
            e.seq.uncounted_tokens = []
    return S.sampling_tensors_from_params(params, seeds, steps, n, prev, draft_before, counts_add)


def token_mask(n: int, entries: Seq[tuple[int, ScheduledSeq]], requests: Mapping[str, Any] | None,
               vocab_size: int) -> Callable[[], S.TokenMask] | None:
    """The builder of the step's TokenMask over ``n`` rows (StepBatch.token_mask), or None
    when no sampled row is constrained. Which rows and what they follow is read now; the
    mask itself is built when called."""
    if requests is None:
        return None
    rows = [(slot, req.constraints[e.seq.sample_index], e.seq.output_token_ids, e.draft)
            for slot, e in entries if e.samples
            for req in (requests[e.seq.request_id],) if req.constraints]
    if not rows:
        return None

    def build() -> S.TokenMask:
        m = G.build_mask(n, vocab_size, rows)
        return S.TokenMask(m.bits, m.bias_ids, m.bias_vals, m.active)

    return build


def wants_scores(e: ScheduledSeq) -> bool:
    """The chunk covers prompt positions whose next token is a prompt token, and the
    sequence asked for prompt logprobs."""
    return e.seq.params.prompt_logprobs is not None and e.start_pos < e.seq.num_prompt_tokens - 1


# The arrays the compiled step takes, the one list of them (the runner's abstract
# arguments, multi-host replay, ``padded_arrays`` and ``as_device_args`` read it): name ->
# (shape in terms of the bucket's T tokens, S slots and P pages, dtype).
STEP_ARRAYS: dict[str, tuple[str, type]] = {
    "tokens": ("T", np.int32), "positions": ("T", np.int32), "slot_mapping": ("T", np.int32),
    "kv_lens": ("S", np.int32), "q_lens": ("S", np.int32), "page_table": ("SP", np.int32),
    "logits_index": ("S", np.int32), "rows": ("S", np.int32), "reset_rows": ("S", np.bool_),
    "token_rows": ("T", np.int32), "token_is_output": ("T", np.bool_), "lora_slots": ("T", np.int32),
    "score_targets": ("T", np.int32), "score_k": ("T", np.int32), "feed_rows": ("T", np.int32),
}


def step_array_shapes(b: Bucket) -> dict[str, tuple[tuple[int, ...], type]]:
    """name -> (shape, dtype) of each step array in bucket ``b``."""
    dims = {"T": (b.num_tokens,), "S": (b.num_seqs,), "SP": (b.num_seqs, b.max_pages)}
    return {k: (dims[axes], dt) for k, (axes, dt) in STEP_ARRAYS.items()}


def as_device_args(batch: StepBatch) -> dict[str, Any]:
    """The arrays the compiled step takes (names match the step's signature; the score
    arrays are unused outside scoring buckets, but one structure serves every step)."""
    return {k: getattr(batch, k) for k in STEP_ARRAYS}


def step_args(batch: StepBatch) -> dict[str, Any]:
    """The step's host arrays as a forward and its sampler take them (and multi-host
    replay publishes them, engine/multihost.py): the model's inputs, the sampler's
    parameters and its rows' penalty-state rows."""
    return {"arrays": as_device_args(batch), "t": batch.sampling, "sample_rows": batch.sample_rows,
            "keep_rows": batch.keep_rows}

"""Iteration-level scheduler: which sequences run in the next step, and how many tokens each.

Host only: plain Python, no jax. One token model for everything (vLLM v1 style): each
sequence needs ``num_tokens - num_computed_tokens`` tokens computed; a step gives each
scheduled sequence a contiguous chunk of them. A prompt is a long chunk (cut to the token
budget: chunked prefill), a decode is a chunk of 1, a resumed preempted sequence
recomputes prompt + outputs the same way. After the step, the engine calls
``postprocess`` (advance ``num_computed_tokens``, append sampled tokens), decides stops
itself, and calls ``finish``.

``schedule()``:

1. Running sequences, decodes (1 token needed) first, then unfinished prefill chunks, each
   in running order (priority, then arrival). Each gets ``min(needed, budget left)``
   tokens and the pages they need. Decodes go first so that a long prefill chunk never
   stalls the decodes behind it (inter-token latency).
   If pages run out, preempt by recompute the last running sequence (lowest priority,
   newest arrival): free its pages, ``num_computed_tokens = 0``, back into the waiting
   queue at its own (priority, arrival) position (ahead of every newer request), keeping
   its output tokens, so resuming recomputes prompt + outputs and samples the next token:
   no token is lost or duplicated. A victim already scheduled this step is unscheduled
   and its tokens go back to the budget. If the sequence that needs pages is itself the
   last, it is the one preempted.
2. If nothing was preempted (pages are tight otherwise), admit waiting sequences in
   (priority, arrival) order while ``max_num_seqs``, the token budget and the pages
   allow; the first chunk may be partial. When the head of the queue does not fit,
   admission stops: later, smaller requests never overtake it, so nothing starves.

Policies (``policy``, vLLM's ``--scheduling-policy``): "fcfs" orders both queues by
arrival alone (a sequence's ``priority`` is ignored; the engine refuses a non-zero one,
as vLLM does). "priority" orders them by (priority, arrival), lower values first, and
admission may preempt: when the waiting head lacks a seat (``max_num_seqs``) or pages, the
lowest-priority running sequence (newest first among equals) whose priority is strictly
lower (a larger value) is preempted by recompute, as in step 1, one at a time until the
head fits or no such sequence is left; a victim already scheduled this step is unscheduled
(its tokens back to the budget) and is not admitted again in the same step. Beam searches
(their seats are reserved for the whole search) and speculation branches are never
victims. Equal priorities never preempt each other, so within a priority it is FCFS.

Long prefills (``long_prefill_token_threshold``, vLLM's knob): while other work shares the
engine (another running sequence, or a waiting one that has a seat), a prefill chunk
(running or admitted) is cut to the threshold, so a 3,500-token prompt no longer takes the
whole budget for seven steps while the requests behind it wait: the budget it leaves
admits them in the same step, and the steps that carry their decodes stay short. It still
gets its chunk every step (running sequences are served before admission), so it cannot
starve. Alone, it prefills at the full budget.

Sampling several completions (``n > 1``): the request becomes ``n`` sequences (see
``sequence.make_sequences``) added together. Their full prompt pages are computed once:
while one sibling is still prefilling that part, the others wait (they are skipped by
admission, which is not starvation: they become admissible as soon as it is done); then
each is admitted with the computed sibling's full prompt pages shared by reference
(``BlockManager.allocate_for(prefix_pages=...)``, refcount + 1) and computes only the
prompt's last partial page, at least one token (so it produces its own logits), and
from there samples its own tokens into its own pages. Full pages are never written again,
so sharing them is safe; partial pages are never shared. With prefix caching enabled a
cache hit is used instead when it is longer.

Prefix caching: admission starts a sequence at its first uncached token (the hit's pages,
device or host tier, are counted as computed; chunked prefill and packing then see only
the rest), always leaving at least its last token to compute so it samples.

Beam search (engine/beam.py): a request with ``beam_width`` W starts as one sequence and
is admitted only when W of the ``max_num_seqs`` places are free; they stay reserved for it
until it ends, so the beams it forks (``fork``: the parent's computed KV shared
copy-on-write) always have a place. A beam's step may append no token
(``postprocess(sampled={seq_id: None})``): the beam search appends once every beam of the
request has its candidates, and a beam waiting for that needs no token, so it is not
scheduled meanwhile. Finished beams leave the request's group at once (a search drops and
forks beams every step).

Prompt logprobs: a sequence that wants them never starts from a prefix-cache hit (the hit's
positions would not be scored); it may still share a sibling's computed prompt pages.

Requests that can never run are refused by ``add`` with ValueError: a prompt longer than
``max_model_len``, or a sequence whose worst-case length (prompt + max_tokens - 1 tokens
of KV, capped at ``max_model_len``) needs more pages than the whole cache has (it would
preempt itself forever). The engine must finish a sequence (reason "length") once it has
``max_tokens`` outputs or ``max_model_len`` tokens; scheduling past ``max_model_len``
raises RuntimeError.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.host_page_index import HostPage
from jaxinfer.engine.sequence import Sequence, SequenceStatus, next_seq_id
# Raised by ``Scheduler.add`` when the waiting queue already holds ``max_waiting``
# sequences (a request with ``n`` samples needs ``n`` places). Transient: retry later (the
# server answers 503). Sequences put back by preemption are never refused. Re-exported
# here; it lives in jaxinfer.errors so the server can catch it without importing us.
from jaxinfer.errors import QueueFullError

__all__ = ["POLICIES", "QueueFullError", "ScheduledSeq", "Scheduler", "SchedulerOutput"]

POLICIES = ("fcfs", "priority")      # vLLM's --scheduling-policy values

_RUNNING, _WAITING = SequenceStatus.RUNNING, SequenceStatus.WAITING
_PREEMPTED, _FINISHED = SequenceStatus.PREEMPTED, SequenceStatus.FINISHED


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's share of a step: compute tokens ``[start_pos, start_pos + num_new_tokens)``.

    ``samples`` is True iff this chunk reaches the sequence's last token, so the step
    produces the next token for it (False for all but the last chunk of a prefill).
    ``draft``: speculative decoding's proposed tokens (engine/speculative.py); then the
    entry is a decode of the last token plus the draft, ``num_new_tokens = 1 + len(draft)``,
    and the step samples at every one of those positions to verify the draft.
    """

    seq: Sequence
    start_pos: int
    num_new_tokens: int
    samples: bool
    draft: tuple[int, ...] = ()


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)   # running first, then admitted
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class _PrefillSlots:
    """The shapes prefill chunks may take in one step (they must fit a compiled bucket):
    ``shapes`` are (slots, chunk) pairs (BucketLadders.prefill_shapes); a chunk of L tokens
    fills ceil(L / chunk) slots of a shape (the batch builder cuts it in pieces), and all
    of a step's chunks must fit one shape. ``None``: no constraint. Chunks of 1 token ride
    in decode slots and are not counted."""

    def __init__(self, shapes: Seq[tuple[int, int]] | None):
        self.shapes = list(shapes) if shapes else None
        self.used = [0] * len(shapes or ())    # slots taken per shape; it fits while used <= slots

    def take(self, want: int) -> int:
        """How many of ``want`` tokens this sequence may compute now (0: not this step)."""
        if want <= 1 or self.shapes is None:
            return want
        n = max((min(want, (s - u) * c) for (s, c), u in zip(self.shapes, self.used) if u < s),
                default=0)
        for i, (s, c) in enumerate(self.shapes):
            self.used[i] += -(-n // c)
        return n

    def give_back(self, n: int) -> None:
        """Undo a ``take`` that returned ``n`` (its sequence was not scheduled after all)."""
        if n <= 1 or self.shapes is None:
            return
        for i, (_, c) in enumerate(self.shapes):
            self.used[i] -= -(-n // c)


def _used(chosen: dict[int, ScheduledSeq]) -> int:
    """The tokens a step's entries so far take from its budget."""
    return sum(e.num_new_tokens for e in chosen.values())


# Auto threshold: max_num_batched_tokens // this = 32 of the default 512, one slot of the
# default prefill ladder. Measured (SmolLM2-135M, 2 CPU cores, `benchmarks/long_prefill.py
# --engine-sweep`: a 3,500-token prompt, 20 completions of 16 tokens added beside it): the
# completions took 1.5-1.6x their time alone at 32, 1.8-2.5x at 64, 3.5x and more at 128
# (each of their decode steps also carries the chunk, whose attention over the long
# prompt's KV dominates on a CPU), 3.7-7x uncapped; the long prompt's first token came
# within the run-to-run noise of its time alone. A device where a step's fixed cost
# dominates may want a larger one (the long prompt then needs fewer steps).
LONG_PREFILL_FRACTION = 16


def long_prefill_threshold(value: int | None, max_num_batched_tokens: int) -> int:
    """EngineConfig.long_prefill_token_threshold resolved: None (auto) ->
    max_num_batched_tokens // LONG_PREFILL_FRACTION (at least 1); 0: no cap."""
    if value is None:
        return max(1, max_num_batched_tokens // LONG_PREFILL_FRACTION)
    return value


def _slot_multiple(threshold: int, shapes: Seq[tuple[int, int]] | None) -> int:
    """``threshold`` rounded up to whole slots of the narrowest compiled prefill slot: a
    chunk pads to whole slots anyway (_PrefillSlots), so the rest of the slot would cost the
    same and compute nothing; and no capped chunk is ever a 1-token one, which would ride
    in a decode slot."""
    if threshold == 0 or not shapes:
        return threshold
    c = min(c for _, c in shapes)
    return -(-threshold // c) * c


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, max_waiting: int | None = None, *,
                 prefill_shapes: Seq[tuple[int, int]] | None = None, max_loras: int | None = None,
                 long_prefill_token_threshold: int = 0, policy: str = "fcfs") -> None:
        for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_model_len", max_model_len)):
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        v = long_prefill_token_threshold
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            raise ValueError(f"long_prefill_token_threshold: must be a non-negative integer, got {v!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {policy!r}")
        if max_waiting is not None and not (isinstance(max_waiting, int) and max_waiting >= 1):
            raise ValueError(f"max_waiting: must be a positive integer or None, got {max_waiting!r}")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.policy = policy
        # Bucket shapes for prefill chunks (see _PrefillSlots); default: no constraint.
        self.prefill_shapes = tuple(prefill_shapes) if prefill_shapes else None
        # The most tokens one prefill chunk gets while other work shares the step (0: no cap).
        self.long_prefill_cap = _slot_multiple(long_prefill_token_threshold, self.prefill_shapes)
        # Multi-LoRA: at most this many distinct adapters (Sequence.lora_id != 0) run at
        # once, the device's adapter slots (None: no limit).
        self.max_loras = max_loras
        # Both queues are kept sorted by _key: (priority, arrival_time, order of add);
        # the priority is 0 for every sequence under "fcfs".
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._requests: dict[str, list[Sequence]] = {}     # unfinished requests' sequences
        self._keys: dict[int, tuple[int, float, int]] = {}
        self._beam_seats: dict[str, int] = {}              # admitted beam requests -> width
        self._branches: set[int] = set()                   # seq_ids of this step's tree branches
        self._num_added = 0
        self.num_preemptions_total = 0
        self.num_cached_tokens_total = 0     # admitted tokens found in the cache (not recomputed)
        self.num_admitted_tokens_total = 0   # tokens to compute at admission, cached included
        # vLLM's prefix-cache counters, in tokens, counted at admission (caching on only)
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0
        self.prefix_cache_host_hits_total = 0  # the part of the hits copied from the host tier

    # ---- stats --------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def page_usage(self) -> float:
        return self.bm.usage

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def prefix_cache_stats(self) -> dict[str, int]:
        """vLLM's prefix-cache counters (tokens) and the pages the cache holds per tier."""
        return {
            "prefix_cache_queries_total": self.prefix_cache_queries_total,
            "prefix_cache_hits_total": self.prefix_cache_hits_total,
            "prefix_cache_host_hits_total": self.prefix_cache_host_hits_total,
            "prefix_cache_pages": self.bm.num_cached_pages,
            "host_cache_pages": self.bm.num_host_cached_pages,
        }

    # ---- requests in and out ------------------------------------------------------
    def add(self, seqs: Sequence | Iterable[Sequence]) -> None:
        """Queue the sequences of one request (all ``n`` samples together).

        Raises ValueError for a request that can never run (see the module doc) or is
        malformed, and QueueFullError when the waiting queue has no room for it.
        """
        group = [seqs] if isinstance(seqs, Sequence) else list(seqs)
        self._validate(group)
        if self.max_waiting is not None and len(self.waiting) + len(group) > self.max_waiting:
            raise QueueFullError(f"waiting queue is full ({len(self.waiting)} of {self.max_waiting} "
                                 f"places taken, request {group[0].request_id!r} needs {len(group)})")
        self._requests[group[0].request_id] = group
        for seq in group:
            self._keys[seq.seq_id] = (seq.priority if self.policy == "priority" else 0,
                                      seq.arrival_time, self._num_added)
            self._num_added += 1
            bisect.insort(self.waiting, seq, key=self._key)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every unfinished sequence of the request now ("abort"), freeing its pages.

        Returns the sequences aborted ([] for an unknown or finished request). Safe between
        ``schedule`` and ``postprocess``: ``postprocess`` skips finished sequences.
        """
        group = self._requests.get(request_id, [])
        aborted = [s for s in group if s.status is not _FINISHED]
        for seq in aborted:
            self.finish(seq, "abort")
        return aborted

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Mark ``seq`` finished (engine: "stop" / "length"; abort: "abort") and free its pages."""
        if seq.status is _FINISHED:
            return
        queue = self.running if seq.status is _RUNNING else self.waiting
        queue.remove(seq)
        self.bm.free(seq)
        seq.status = _FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self._keys.pop(seq.seq_id, None)
        group = self._requests.get(seq.request_id)
        if group is not None and seq.params.beam_width > 1:
            group.remove(seq)
        if group is not None and all(s.status is _FINISHED for s in group):
            del self._requests[seq.request_id]
            self._beam_seats.pop(seq.request_id, None)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Beam search: ``child`` (a fresh sequence of ``parent``'s request, holding the
        same tokens) continues from ``parent``'s computed KV (BlockManager.fork), in one of
        the places its request reserved. Without a free page for the copy, it waits to
        recompute its tokens like a preempted sequence."""
        if parent.status is not _RUNNING or child.status is not _WAITING or child.page_ids:
            raise ValueError(f"fork: {parent!r} must be running and {child!r} fresh")
        self._keys[child.seq_id] = self._keys[parent.seq_id]
        self._requests[parent.request_id].append(child)
        if self.bm.fork(parent, child):
            child.status = _RUNNING
            child.num_computed_tokens = parent.num_computed_tokens
            bisect.insort(self.running, child, key=self._key)
        else:
            child.status = _PREEMPTED
            bisect.insort(self.waiting, child, key=self._key)

    def branch(self, parent: Sequence) -> Sequence | None:
        """Token-tree speculation (engine/spec_tree.py): a short-lived copy of decoding
        ``parent`` that continues from its computed KV (BlockManager.fork: full pages shared,
        the partial last page copied) and is scheduled right after it for one step; not a
        sample of the request (``drop_branch`` ends it). None if no page is free for the copy."""
        child = Sequence(next_seq_id(), parent.request_id, parent.prompt_token_ids, parent.params,
                         sample_index=parent.sample_index, priority=parent.priority,
                         arrival_time=parent.arrival_time, output_token_ids=list(parent.output_token_ids),
                         lora_id=parent.lora_id)
        if parent.status is not _RUNNING or not self.bm.fork(parent, child):
            return None
        child.status = _RUNNING
        child.num_computed_tokens = parent.num_computed_tokens
        self._keys[child.seq_id] = self._keys[parent.seq_id]
        bisect.insort(self.running, child, key=self._key)
        self._branches.add(child.seq_id)
        return child

    def is_branch(self, seq: Sequence) -> bool:
        """Whether ``seq`` is a ``branch`` (it takes no place in ``max_num_seqs`` and no
        penalty-state row: it never has penalties)."""
        return seq.seq_id in self._branches

    def drop_branch(self, child: Sequence) -> None:
        """End a ``branch``: out of the queues, its pages back to the pool (or to the
        parent's, when the parent took them: BlockManager.swap_pages)."""
        for queue in (self.running, self.waiting):
            if child in queue:
                queue.remove(child)
        self.bm.free(child)
        self._keys.pop(child.seq_id, None)
        self._branches.discard(child.seq_id)
        child.status = _FINISHED

    def drop_branches(self) -> None:
        """End every ``branch`` still alive (a step that failed before its tree was resolved)."""
        for child in [s for s in self.running + self.waiting if s.seq_id in self._branches]:
            self.drop_branch(child)

    # ---- the step -----------------------------------------------------------------
    def schedule(self, drafts: dict[int, Seq[int]] | None = None) -> SchedulerOutput:
        """``drafts``: seq_id -> proposed tokens for decoding sequences (speculative
        decoding); each such sequence is budgeted and given pages for 1 + len(draft)
        tokens (the draft cut to the budget left)."""
        budget = self.max_num_batched_tokens
        drafts = drafts or {}
        chosen: dict[int, ScheduledSeq] = {}          # seq_id -> entry, in schedule order
        preempted: list[Sequence] = []
        slots = _PrefillSlots(self.prefill_shapes)

        cap = self._chunk_cap()
        ready = [s for s in self.running if not self._deferred(s)]
        decodes = [s for s in ready if s.num_new_tokens_needed == 1]
        prefills = [s for s in ready if s.num_new_tokens_needed > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not _RUNNING:            # preempted earlier in this loop
                continue
            draft = tuple(drafts.get(seq.seq_id, ()))[:budget - 1] if seq.num_new_tokens_needed == 1 else ()
            num_new = 1 + len(draft) if draft else slots.take(min(seq.num_new_tokens_needed, budget, cap))
            if num_new == 0:
                continue
            target = seq.num_computed_tokens + num_new
            self._check_len(seq, target)
            while not self.bm.allocate_for(seq, target):
                victim = self.running[-1]
                undone = chosen.pop(victim.seq_id, None)
                if undone is not None:
                    budget += undone.num_new_tokens
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                chosen[seq.seq_id] = ScheduledSeq(seq, seq.num_computed_tokens, num_new,
                                                  target >= seq.num_tokens, draft)
                budget -= num_new

        if not preempted:
            budget = self._admit(budget, chosen, slots, cap, preempted)

        scheduled = list(chosen.values())
        return SchedulerOutput(scheduled, preempted, self.max_num_batched_tokens - budget)

    def schedule_decode_run(self, max_steps: int) -> tuple[SchedulerOutput, int] | None:
        """A multi-step decode (``EngineConfig.num_scheduler_steps``): every running sequence
        decodes for ``k`` steps (2 <= k <= max_steps) in one device call; or None, and the
        engine runs a normal ``schedule()``.

        Only when nothing else wants the step: every running sequence needs exactly one
        token, and no waiting sequence could be admitted now (the queue is empty or
        ``max_num_seqs`` are running), so a multi-step run delays no prefill. ``k`` stops
        at the first sequence's ``max_tokens`` or ``max_model_len``, so no position past
        either is ever computed. Pages for all ``k`` positions are allocated up front
        (all or nothing: without enough free pages, None, nothing changed and nobody
        preempted). The engine then feeds the ``k`` tokens back through ``postprocess``
        one step at a time, and stops a sequence early (EOS, stop string): the tokens it
        sampled after that are dropped, and its pages freed as usual.
        """
        if max_steps < 2 or not self.running or len(self.running) > self.max_num_batched_tokens:
            return None
        if self.waiting and (len(self.running) < self.max_num_seqs or self._victim_for(self.waiting[0])):
            return None                   # admission (or a priority preemption) is due
        k = max_steps
        for seq in self.running:
            if seq.num_new_tokens_needed != 1:
                return None
            k = min(k, seq.params.max_tokens - seq.num_output_tokens,
                    self.max_model_len - seq.num_computed_tokens)
        if k < 2:
            return None
        need = sum(max(0, self.bm.pages_for(s.num_computed_tokens + k) - len(s.page_ids)) for s in self.running)
        if need > self.bm.num_free_pages:
            return None
        for seq in self.running:
            if not self.bm.allocate_for(seq, seq.num_computed_tokens + k):
                raise RuntimeError(f"allocate_for({seq!r}) failed after the free-page check")
        out = SchedulerOutput([ScheduledSeq(s, s.num_computed_tokens, 1, True) for s in self.running],
                              [], len(self.running))
        return out, k

    def postprocess(self, output: SchedulerOutput, sampled: dict[int, int | None]) -> list[Sequence]:
        """Record a finished step: ``commit`` then ``resolve`` (the synchronous form, and the
        one token runs of multi-step decode and speculation are replayed through)."""
        self.commit(output)
        return self.resolve(output, sampled)

    def commit(self, output: SchedulerOutput) -> None:
        """A step was dispatched: advance ``num_computed_tokens`` of every scheduled
        sequence (its KV will be in the cache), and count the token each sampling entry
        will get as pending (``Sequence.num_pending``), so the next ``schedule`` plans
        with it before it reaches the host (the overlapped loop, engine.py)."""
        for entry in output.scheduled:
            seq = entry.seq
            if seq.status is _FINISHED:           # aborted since it was scheduled
                continue
            if seq.num_computed_tokens != entry.start_pos or seq.status is not _RUNNING:
                raise RuntimeError(f"commit: {seq!r} does not match its scheduled entry "
                                   f"(start_pos {entry.start_pos}); was this step already committed?")
            seq.num_computed_tokens += entry.num_new_tokens
            if entry.samples:
                seq.num_pending += 1

    def resolve(self, output: SchedulerOutput, sampled: dict[int, int | None]) -> list[Sequence]:
        """A committed step's tokens reached the host: append ``sampled[seq_id]`` to every
        sequence whose entry ``samples`` (None: the caller appends, beam search, or stops),
        and register newly full pages in the prefix cache. Sequences finished meanwhile
        are skipped; one preempted meanwhile still gets its token (it was sampled from
        its computed KV, as the synchronous loop would have appended it before the
        preemption). Returns the sequences that received a token, in schedule order; the
        engine then checks stops on them and calls ``finish``."""
        grew: list[Sequence] = []
        for entry in output.scheduled:
            seq = entry.seq
            if seq.status is _FINISHED:
                continue
            if entry.samples:
                try:
                    tok = sampled[seq.seq_id]
                except KeyError:
                    raise KeyError(f"resolve: no sampled token for seq_id {seq.seq_id}, "
                                   f"whose entry samples") from None
                seq.num_pending -= 1
                if tok is not None:
                    seq.append_token(int(tok))
                    grew.append(seq)
            if seq.status is _RUNNING:
                self.bm.cache_computed(seq)
        return grew

    # ---- internals ----------------------------------------------------------------
    def _key(self, seq: Sequence) -> tuple[int, float, int]:
        return self._keys[seq.seq_id]

    def _deferred(self, seq: Sequence) -> bool:
        """Not scheduled while a token of it is in flight (the overlapped loop): a request
        that needs the host between steps (SamplingParams.needs_host_between_steps), and
        one whose pending token ends it by length (max_tokens or max_model_len: the
        synchronous loop would have finished it)."""
        if not seq.num_pending:
            return False
        return (seq.params.needs_host_between_steps or seq.num_tokens >= self.max_model_len
                or seq.num_output_tokens + seq.num_pending >= seq.params.max_tokens)

    def _seats_taken(self) -> int:
        """Places in ``max_num_seqs`` in use: running sequences and beam reservations."""
        reserved = 0
        for rid, width in self._beam_seats.items():
            reserved += width - sum(s.status is _RUNNING for s in self._requests[rid])
        return len(self.running) + reserved

    def _seats_needed(self, seq: Sequence) -> int:
        if seq.request_id in self._beam_seats:
            return 0                                  # a beam of an admitted search: reserved
        return seq.params.beam_width

    def _chunk_cap(self) -> int:
        """The most tokens one prefill chunk may take this step: ``long_prefill_cap`` while
        sequences of at least two requests could run (the running ones and as many waiting
        ones as there are free seats), else the whole budget, so a lone prompt (or a lone
        request's ``n`` samples or beams) prefills at full speed."""
        if not self.long_prefill_cap:
            return self.max_num_batched_tokens
        free = max(0, self.max_num_seqs - self._seats_taken())
        first = None
        for seq in itertools.chain(self.running, self.waiting[:free]):
            if first is None:
                first = seq.request_id
            elif seq.request_id != first:
                return self.long_prefill_cap
        return self.max_num_batched_tokens

    def _admit(self, budget: int, chosen: dict[int, ScheduledSeq], slots: _PrefillSlots, cap: int,
               preempted: list[Sequence]) -> int:
        i = 0
        seats = self._seats_taken()
        while i < len(self.waiting) and budget > 0:
            seq = self.waiting[i]
            if seq.num_pending or seq in preempted:
                # preempted with a token in flight: it recomputes once that is here; or
                # preempted by this very admission (no thrash within one step)
                i += 1
                continue
            prefix = None if self._lora_full(seq) else self._prefix_for(seq)
            if prefix is None:      # a sibling is computing our prompt pages, or no adapter slot
                i += 1
                continue
            if seats + self._seats_needed(seq) > self.max_num_seqs:
                if self._make_room(seq, chosen, slots, preempted):
                    budget, seats = self.max_num_batched_tokens - _used(chosen), self._seats_taken()
                    continue
                break                                 # FCFS: a beam search waits for its places
            cached = len(prefix) * self.bm.page_size
            num_new = slots.take(min(seq.num_tokens - cached, budget, cap))
            if num_new == 0:
                break                                 # no prefill slot left this step
            target = cached + num_new
            self._check_len(seq, target)
            if not self.bm.allocate_for(seq, target, prefix_pages=prefix):
                if self._make_room(seq, chosen, slots, preempted):
                    slots.give_back(num_new)
                    budget, seats = self.max_num_batched_tokens - _used(chosen), self._seats_taken()
                    continue                          # again with the pages the victim left
                break                                 # FCFS: nobody overtakes the head
            self.waiting.pop(i)
            seats += self._seats_needed(seq)      # before _start reserves a beam's seats
            self._start(seq, cached, prefix)
            chosen[seq.seq_id] = ScheduledSeq(seq, cached, num_new, target == seq.num_tokens)
            budget -= num_new
        return budget

    def _start(self, seq: Sequence, cached: int, prefix: list[int | HostPage]) -> None:
        """``seq`` admitted (its pages allocated): running, counted, its beam seats reserved."""
        seq.status = _RUNNING
        seq.num_computed_tokens = cached
        seq.num_cached_tokens = cached
        if seq.params.beam_width > 1:
            self._beam_seats[seq.request_id] = seq.params.beam_width
        self.num_cached_tokens_total += cached
        self.num_admitted_tokens_total += seq.num_tokens
        if self.bm.enable_prefix_caching:
            self.prefix_cache_queries_total += seq.num_tokens
            self.prefix_cache_hits_total += cached
            self.prefix_cache_host_hits_total += self.bm.page_size * sum(
                isinstance(p, HostPage) for p in prefix)
        bisect.insort(self.running, seq, key=self._key)

    def _victim_for(self, seq: Sequence) -> Sequence | None:
        """"priority" policy: the running sequence to preempt so that waiting ``seq`` can
        start: the last in running order (lowest priority, newest) of those that are not a
        beam search's nor a speculation branch, if its priority is strictly lower than
        ``seq``'s; else None (always None under "fcfs")."""
        if self.policy != "priority":
            return None
        for victim in reversed(self.running):
            if victim.params.beam_width > 1 or victim.seq_id in self._branches:
                continue
            return victim if self._key(victim)[0] > self._key(seq)[0] else None
        return None

    def _make_room(self, seq: Sequence, chosen: dict[int, ScheduledSeq], slots: _PrefillSlots,
                   preempted: list[Sequence]) -> bool:
        """Preempt one ``_victim_for(seq)``, unscheduled (its prefill slots given back) if
        this step had it; False if there is none."""
        victim = self._victim_for(seq)
        if victim is None:
            return False
        undone = chosen.pop(victim.seq_id, None)
        if undone is not None and not undone.draft:
            slots.give_back(undone.num_new_tokens)
        self._preempt(victim)
        preempted.append(victim)
        return True

    def _lora_full(self, seq: Sequence) -> bool:
        """``seq`` needs an adapter that no running sequence uses while ``max_loras`` distinct
        adapters already run: it waits (later requests of running adapters or of the base
        model are admitted past it, as vLLM does)."""
        if not seq.lora_id or self.max_loras is None:
            return False
        running = {s.lora_id for s in self.running if s.lora_id}
        return seq.lora_id not in running and len(running) >= self.max_loras

    def _prefix_for(self, seq: Sequence) -> list[int | HostPage] | None:
        """Computed pages ``seq`` can start from, or None if it should wait for a sibling."""
        p = seq.params
        if p.penalized:
            # The device rebuilds penalty state from the tokens a sequence feeds, so a
            # penalized sequence computes its whole prompt itself.
            return []
        # prompt logprobs: every position must be computed (and scored) by the group
        cache_hit = [] if p.prompt_logprobs is not None else self.bm.lookup_prefix(seq)
        group = self._requests[seq.request_id]
        # Full pages of the prompt, leaving >= 1 token to compute.
        k = min(seq.num_prompt_tokens, seq.num_tokens - 1) // self.bm.page_size
        if len(group) == 1 or k == 0 or len(cache_hit) >= k:
            return cache_hit
        busy = False
        for sib in group:
            if sib is seq or sib.status is not _RUNNING:
                continue
            if sib.num_computed_tokens >= k * self.bm.page_size:
                return sib.page_ids[:k]
            busy = True
        return None if busy else cache_hit

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.uncounted_tokens = []          # the recompute feeds (and counts) every token again
        seq.status = _PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        bisect.insort(self.waiting, seq, key=self._key)

    def _check_len(self, seq: Sequence, target: int) -> None:
        if target > self.max_model_len:
            raise RuntimeError(f"{seq!r} would hold {target} tokens > max_model_len={self.max_model_len}; "
                               f"the engine must finish sequences that reach max_model_len")

    def _validate(self, group: list[Sequence]) -> None:
        if not group:
            raise ValueError("add: no sequences given")
        first = group[0]
        rid = first.request_id
        if rid in self._requests:
            raise ValueError(f"request_id {rid!r} is already queued or running")
        if self.max_waiting is not None and len(group) > self.max_waiting:
            raise ValueError(f"request {rid!r} has {len(group)} samples but max_waiting is {self.max_waiting}")
        for seq in group:
            if seq.request_id != rid or seq.prompt_token_ids != first.prompt_token_ids:
                raise ValueError(f"add: sequences of one call must share request_id and prompt ({seq!r})")
            if seq.status is not _WAITING or seq.page_ids or seq.num_computed_tokens or seq.output_token_ids:
                raise ValueError(f"add: {seq!r} is not a fresh sequence")
        n_prompt = first.num_prompt_tokens
        if n_prompt == 0:
            raise ValueError(f"request {rid!r}: the prompt is empty")
        if n_prompt > self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt has {n_prompt} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        worst = min(n_prompt + first.params.max_tokens - 1, self.max_model_len)
        need = self.bm.pages_for(worst)
        width = first.params.beam_width
        if width > self.max_num_seqs:
            raise ValueError(f"request {rid!r}: beam_width={width} is more than max_num_seqs="
                             f"{self.max_num_seqs} (the beams run side by side)")
        if width > 1:       # the prompt's full pages are shared, the rest is each beam's own
            shared = n_prompt // self.bm.page_size
            need = shared + width * (need - shared)
        if need > self.bm.num_usable_pages:
            raise ValueError(
                f"request {rid!r}: prompt ({n_prompt} tokens) + max_tokens ({first.params.max_tokens}) "
                f"needs up to {worst} tokens of KV = {need} pages of {self.bm.page_size}, but the whole "
                f"KV cache has {self.bm.num_usable_pages} pages; lower max_tokens or enlarge the cache")

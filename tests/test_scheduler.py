"""Scheduler: budgets, chunked prefill, preemption, abort, ordering, n>1 sharing (host only).

The fake model below keeps a real paged "KV cache" (each slot stores the token and
position written there) and, before sampling, reads a sequence's whole context back
through its page table. So a wrong position, a page written by two sequences, a freed
page reused too early, or a shared/cached page that doesn't hold what it should, all
show up as a context mismatch. Its next token depends only on (request, sample index,
output index), so the expected outputs are known whatever the scheduling was.
"""

from __future__ import annotations

import random
import subprocess
import sys
import zlib
from collections import Counter

import pytest

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.scheduler import QueueFullError, Scheduler, SchedulerOutput
from jaxinfer.engine.sequence import Sequence, SequenceStatus, make_sequences

VOCAB = 1000


def _stable_hash(*parts: object) -> int:
    """Independent of PYTHONHASHSEED (str hashes are salted per process)."""
    return zlib.crc32(repr(parts).encode())


def expected_token(seq: Sequence, index: int) -> int:
    return _stable_hash(seq.request_id, seq.sample_index, index, "tok") % VOCAB


class FakeModel:
    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.slots: list[list[tuple[int, int] | None]] = [[None] * bm.page_size for _ in range(bm.num_pages)]

    def step(self, out: SchedulerOutput) -> dict[int, int]:
        ps = self.bm.page_size
        for e in out.scheduled:                       # all writes first, as one batch
            seq = e.seq
            assert 0 not in seq.page_ids
            assert e.start_pos == seq.num_computed_tokens and e.num_new_tokens >= 1
            assert len(seq.page_ids) * ps >= e.start_pos + e.num_new_tokens
            toks = tokens(seq, e.start_pos, e.start_pos + e.num_new_tokens)
            for j, t in enumerate(toks):
                pos = e.start_pos + j
                page = seq.page_ids[pos // ps]
                assert self.bm.refcount(page) == 1, "write into a shared page"
                self.slots[page][pos % ps] = (t, pos)
        sampled = {}
        for e in out.scheduled:
            seq = e.seq
            end = e.start_pos + e.num_new_tokens
            assert e.samples == (end == seq.num_tokens)
            # a length stop is known ahead: its last token is never fed (no look-ahead past it)
            assert end <= seq.num_prompt_tokens + seq.params.max_tokens - 1 or seq.num_output_tokens == 0
            ctx = [self.slots[seq.page_ids[p // ps]][p % ps] for p in range(end)]
            assert ctx == [(t, p) for p, t in enumerate(tokens(seq, 0, end))], "KV context mismatch"
            # Every row gets a token, as a real step would; postprocess must ignore non-samplers.
            index = seq.num_output_tokens + seq.num_pending
            sampled[seq.seq_id] = expected_token(seq, index) if e.samples else -1
        return sampled


def tokens(seq: Sequence, start: int, end: int) -> list[int]:
    """Tokens [start, end) of ``seq`` as the device sees them: a pending one (sampled by a
    step in flight, the overlapped loop) is the token that step samples."""
    known = seq.token_ids_slice(start, min(end, seq.num_known_tokens))
    pending = [expected_token(seq, p - seq.num_prompt_tokens) for p in range(max(start, seq.num_known_tokens), end)]
    assert len(pending) <= seq.num_pending, "fed a token nobody sampled"
    return known + pending


def run_step(sched: Scheduler, model: FakeModel, max_model_len: int | None = None) -> SchedulerOutput:
    out = sched.schedule()
    assert out.num_batched_tokens == sum(e.num_new_tokens for e in out.scheduled)
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert len({e.seq.seq_id for e in out.scheduled}) == len(out.scheduled)
    assert sched.num_running <= sched.max_num_seqs
    sampled = model.step(out)
    for seq in sched.postprocess(out, sampled):
        # The engine's stop logic: max_tokens, or the model's length limit.
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, "length")
        elif max_model_len is not None and seq.num_tokens >= max_model_len:
            sched.finish(seq, "length")
    return out


def engine_stops(sched: Scheduler, grew: list[Sequence], max_model_len: int | None) -> None:
    """The engine's stop logic: max_tokens, or the model's length limit."""
    for seq in grew:
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, "length")
        elif max_model_len is not None and seq.num_known_tokens >= max_model_len:
            sched.finish(seq, "length")


def run_step_overlapped(sched: Scheduler, model: FakeModel, max_model_len: int,
                        in_flight: list[tuple[SchedulerOutput, dict]]) -> SchedulerOutput:
    """The overlapped loop's order (engine.py): schedule and commit step N+1 while step N
    is in flight, then resolve step N (its stops seen a step late)."""
    out = sched.schedule()
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert sched.num_running <= sched.max_num_seqs
    if out.scheduled:
        sampled = model.step(out)
        sched.commit(out)
        in_flight.append((out, sampled))
    while len(in_flight) > (1 if out.scheduled else 0):
        done, sampled = in_flight.pop(0)
        engine_stops(sched, sched.resolve(done, sampled), max_model_len)
    return out


def make(num_pages=64, page_size=4, max_num_seqs=8, budget=64, max_model_len=256,
         max_waiting=None, prefix_caching=False, cap=0, prefill_shapes=None, policy="fcfs"):
    bm = BlockManager(num_pages, page_size, enable_prefix_caching=prefix_caching)
    return Scheduler(bm, max_num_seqs, budget, max_model_len, max_waiting, prefill_shapes=prefill_shapes,
                     long_prefill_token_threshold=cap, policy=policy), FakeModel(bm)


def add(sched: Scheduler, rid: str, prompt_len: int, max_tokens: int = 4, n: int = 1,
        priority: int = 0, t: float | None = None, prompt: list[int] | None = None) -> list[Sequence]:
    prompt = prompt if prompt is not None else [_stable_hash(rid, i) % VOCAB for i in range(prompt_len)]
    seqs = make_sequences(rid, prompt, SamplingParams(n=n, max_tokens=max_tokens),
                          priority=priority, arrival_time=t)
    sched.add(seqs)
    return seqs


def assert_outputs_exact(seqs: list[Sequence]) -> None:
    for s in seqs:
        assert s.status is SequenceStatus.FINISHED
        want = [expected_token(s, i) for i in range(s.num_output_tokens)]
        assert s.output_token_ids == want


def assert_no_leak(sched: Scheduler) -> None:
    sched.bm.check_invariants()
    assert not sched.has_unfinished()
    assert sched.bm.num_used_pages == 0
    assert sched.bm.num_free_pages == sched.bm.num_usable_pages


def test_chunked_prefill_covers_prompt_once_then_single_token_decodes():
    sched, model = make(budget=32)
    (seq,) = add(sched, "a", 100, max_tokens=3)
    chunks = []
    while sched.has_unfinished():
        out = run_step(sched, model)
        chunks += [(e.start_pos, e.num_new_tokens, e.samples) for e in out.scheduled]
    assert chunks == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True),
                      (100, 1, True), (101, 1, True)]
    assert seq.num_output_tokens == 3 and seq.finish_reason == "length"
    assert_outputs_exact([seq])
    assert_no_leak(sched)


def test_budget_shared_decodes_first_and_partial_admission():
    sched, model = make(budget=10, max_num_seqs=8)
    a = add(sched, "a", 3, max_tokens=10)[0]
    b = add(sched, "b", 3, max_tokens=10)[0]
    run_step(sched, model)                               # both prompts (3 + 3)
    c = add(sched, "c", 30, max_tokens=2)[0]
    out = run_step(sched, model)
    # Decodes of a and b (1 each), then c admitted with the 8 tokens left.
    assert [(e.seq.request_id, e.start_pos, e.num_new_tokens) for e in out.scheduled] == \
        [("a", 3, 1), ("b", 3, 1), ("c", 0, 8)]
    out = run_step(sched, model)
    # c's prefill chunk still goes after the decodes: a long prefill never stalls them.
    assert [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled] == [("a", 1), ("b", 1), ("c", 8)]
    assert out.num_batched_tokens == 10
    while sched.has_unfinished():
        run_step(sched, model)
    assert_outputs_exact([a, b, c])
    assert_no_leak(sched)


def test_max_num_seqs_and_fcfs_order():
    sched, model = make(max_num_seqs=2, budget=100)
    seqs = [add(sched, f"r{i}", 5, max_tokens=2, t=float(i))[0] for i in range(5)]
    out = sched.schedule()
    assert [e.seq.request_id for e in out.scheduled] == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 3
    admitted = []
    sampled = model.step(out)
    sched.postprocess(out, sampled)
    admitted += [e.seq.request_id for e in out.scheduled if e.start_pos == 0]
    while sched.has_unfinished():
        out = run_step(sched, model)
        admitted += [e.seq.request_id for e in out.scheduled if e.start_pos == 0]
        assert sched.num_running <= 2
    assert admitted == [f"r{i}" for i in range(5)]
    assert_outputs_exact(seqs)
    assert_no_leak(sched)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_then_fcfs(policy):
    """"priority": lower values first, arrival order within one; "fcfs" ignores priorities."""
    sched, model = make(max_num_seqs=1, budget=100, policy=policy)
    add(sched, "late-low", 4, priority=5, t=0.0)
    add(sched, "hi-2", 4, priority=-1, t=2.0)
    add(sched, "hi-1", 4, priority=-1, t=1.0)
    add(sched, "mid", 4, priority=0, t=0.5)
    order = []
    while sched.has_unfinished():
        out = run_step(sched, model)
        order += [e.seq.request_id for e in out.scheduled if e.start_pos == 0]
    want = ["hi-1", "hi-2", "mid", "late-low"] if policy == "priority" else ["late-low", "mid", "hi-1", "hi-2"]
    assert order == want
    assert sched.num_preemptions_total == 0      # one at a time, each ran to its end
    assert_no_leak(sched)


def test_unknown_policy_refused():
    with pytest.raises(ValueError, match="policy"):
        make(policy="lifo")


@pytest.mark.parametrize("overlap", [False, True])
def test_priority_preempts_for_a_seat(overlap):
    """"priority": every seat held by low-priority decodes, a high-priority request
    arrives: the newest low one is preempted at once (not after it finishes), the high one
    runs, and the victim resumes after it with exactly its tokens. "fcfs" would wait."""
    sched, model = make(max_num_seqs=2, budget=100, policy="priority")
    lows = [add(sched, f"low{i}", 6, max_tokens=12, priority=1, t=float(i))[0] for i in range(2)]
    in_flight: list = []
    step = (lambda: run_step_overlapped(sched, model, 256, in_flight)) if overlap else (lambda: run_step(sched, model))
    for _ in range(3):
        step()
    hi = add(sched, "hi", 6, max_tokens=3, priority=0, t=9.0)[0]
    out = step()                     # overlapped: scheduled while the step before is in flight
    assert out.preempted == [lows[1]] and hi in [e.seq for e in out.scheduled]
    assert lows[1] not in [e.seq for e in out.scheduled]
    assert lows[1].num_preemptions == 1 and lows[0].num_preemptions == 0
    finished = []
    while sched.has_unfinished() or in_flight:
        step()
        finished += [s.request_id for s in lows + [hi] if s.is_finished and s.request_id not in finished]
    assert finished.index("hi") < finished.index("low1")
    assert_outputs_exact(lows + [hi])
    assert_no_leak(sched)


@pytest.mark.parametrize("shapes", [None, ((1, 16),)])
def test_priority_preempts_for_pages_not_for_equals(shapes):
    """Pages short: the high-priority head preempts the lowest-priority running sequence
    (not an equal one), and only as many as it needs. ``shapes``: one prefill slot per
    step, which the retry after the preemption must still find free."""
    sched, model = make(num_pages=9, page_size=4, max_num_seqs=8, budget=100, policy="priority",
                        prefill_shapes=shapes)
    a = add(sched, "a", 12, max_tokens=4, priority=2, t=0.0)[0]    # 3 pages + growth
    b = add(sched, "b", 12, max_tokens=4, priority=1, t=1.0)[0]
    while SequenceStatus.WAITING in (a.status, b.status):     # one prompt per step with one slot
        run_step(sched, model)
    hi = add(sched, "hi", 12, max_tokens=2, priority=0, t=2.0)[0]   # needs 4 pages: 8 usable, 6-7 held
    eq = add(sched, "eq", 12, max_tokens=2, priority=1, t=3.0)[0]   # equal to b: never preempts it
    out = run_step(sched, model)
    assert [s.request_id for s in out.preempted] == ["a"]
    assert hi in [e.seq for e in out.scheduled] and b.status is SequenceStatus.RUNNING
    assert eq.status is SequenceStatus.WAITING and b.num_preemptions == 0
    while sched.has_unfinished():
        run_step(sched, model)
    assert_outputs_exact([a, b, hi, eq])
    assert_no_leak(sched)


def test_head_of_queue_is_not_overtaken():
    # 10 usable pages of 4. A holds 6; the big B (needs 5) doesn't fit; the small C
    # (needs 1) would, but must not jump ahead of B.
    sched, model = make(num_pages=11, page_size=4, budget=100)
    a = add(sched, "A", 24, max_tokens=1)[0]
    run_step(sched, model)                     # A prefills and finishes (max_tokens=1)
    assert a.status is SequenceStatus.FINISHED
    a2 = add(sched, "A2", 24, max_tokens=3)[0]
    run_step(sched, model)
    b = add(sched, "B", 20, max_tokens=1)[0]
    c = add(sched, "C", 2, max_tokens=1)[0]
    out = run_step(sched, model)
    assert [e.seq.request_id for e in out.scheduled] == ["A2"]
    assert b.status is SequenceStatus.WAITING and c.status is SequenceStatus.WAITING
    while sched.has_unfinished():
        run_step(sched, model)
    assert_outputs_exact([a, a2, b, c])
    assert_no_leak(sched)


def test_preempt_newest_and_resume_recomputes_prompt_and_outputs():
    # 6 usable pages of 4 slots; two sequences of 8-token prompts grow until they collide.
    # A third, newer request waits (max_num_seqs=2) and must stay behind the preempted one.
    sched, model = make(num_pages=7, page_size=4, budget=64, max_model_len=64, max_num_seqs=2)
    old = add(sched, "old", 8, max_tokens=12, t=0.0)[0]
    new = add(sched, "new", 8, max_tokens=12, t=1.0)[0]
    third = add(sched, "third", 8, max_tokens=2, t=2.0)[0]
    admitted = []
    preempted_at = None
    log = []
    while sched.has_unfinished():
        before = new.num_output_tokens
        new.uncounted_tokens = [7]        # as if its last step accepted a draft token (penalties)
        out = run_step(sched, model)
        log.append([(e.seq.request_id, e.start_pos, e.num_new_tokens) for e in out.scheduled])
        admitted += [e.seq.request_id for e in out.scheduled if e.start_pos == 0]
        if out.preempted and preempted_at is None:
            assert out.preempted == [new]             # the newest goes, never the oldest
            assert new.status is SequenceStatus.PREEMPTED and new.page_ids == []
            assert new.num_computed_tokens == 0 and new.num_output_tokens == before
            assert new.uncounted_tokens == []          # the recompute counts every token again
            assert sched.waiting == [new, third]      # front of the queue
            preempted_at = (len(log), before)
    assert preempted_at is not None and old.num_preemptions == 0 and new.num_preemptions >= 1
    step, n_out = preempted_at
    # On resume, the first chunk recomputes prompt + the outputs it already had.
    resume = next(e for entries in log[step:] for e in entries if e[0] == "new")
    assert resume == ("new", 0, 8 + n_out)
    assert sched.num_preemptions_total == new.num_preemptions + third.num_preemptions
    assert old.num_output_tokens == new.num_output_tokens == 12
    assert admitted[:4] == ["old", "new", "new", "third"]     # third never overtook new
    assert_outputs_exact([old, new, third])
    assert_no_leak(sched)


def test_self_preemption_when_it_is_the_newest():
    # A sequence that is itself the newest running one and can't grow is preempted itself.
    # 3 usable pages of 2, all taken by the prompts. Step 2: a (4 tokens) still fits its
    # 2 pages, b (3 tokens) needs a second page; b is the newest, so b preempts itself.
    sched, model = make(num_pages=4, page_size=2, budget=64, max_model_len=64)
    a = add(sched, "a", 3, max_tokens=4, t=0.0)[0]
    b = add(sched, "b", 2, max_tokens=4, t=1.0)[0]
    run_step(sched, model)
    out = run_step(sched, model)
    assert out.preempted == [b] and [e.seq for e in out.scheduled] == [a]
    while sched.has_unfinished():
        run_step(sched, model)
    assert a.num_preemptions == 0 and b.num_preemptions == 1
    assert_outputs_exact([a, b])
    assert_no_leak(sched)


def test_abort_frees_at_once_even_mid_step():
    sched, model = make(budget=8)
    a = add(sched, "a", 20, max_tokens=5, n=2)
    b = add(sched, "b", 4)[0]
    out = sched.schedule()
    used = sched.bm.num_used_pages
    assert used > 0
    aborted = sched.abort("a")
    assert aborted and set(aborted) <= set(a)
    assert all(s.status is SequenceStatus.FINISHED and s.finish_reason == "abort" and s.page_ids == []
               for s in a)
    assert sched.bm.num_used_pages < used
    assert sched.abort("a") == [] and sched.abort("nope") == []
    sampled = {e.seq.seq_id: 1 for e in out.scheduled}
    sched.postprocess(out, sampled)              # skips the aborted entries
    assert all(s.num_output_tokens == 0 for s in a)
    while sched.has_unfinished():
        run_step(sched, model)
    assert_outputs_exact([b])
    assert_no_leak(sched)


def test_validation_errors():
    sched, _ = make(num_pages=5, page_size=4, max_model_len=32, max_waiting=3)
    with pytest.raises(ValueError, match="max_model_len"):
        add(sched, "long", 33)
    with pytest.raises(ValueError, match="pages"):
        add(sched, "big", 20, max_tokens=8)     # 27 tokens of KV = 7 pages > 4
    with pytest.raises(ValueError, match="empty"):
        add(sched, "empty", 0, prompt=[])
    add(sched, "ok", 4, max_tokens=4)
    with pytest.raises(ValueError, match="already"):
        add(sched, "ok", 4)
    with pytest.raises(ValueError, match="max_waiting"):
        add(sched, "wide", 4, n=4)
    add(sched, "ok2", 4, n=2)
    with pytest.raises(QueueFullError):
        add(sched, "one-too-many", 4)
    assert sched.num_waiting == 3
    sched.schedule()                             # admits, making room
    add(sched, "now-fits", 4)
    with pytest.raises(ValueError):
        Scheduler(BlockManager(4, 4), 0, 8, 8)


def test_parallel_samples_share_prompt_pages():
    ps = 4
    sched, model = make(num_pages=32, page_size=ps, budget=64)
    seqs = add(sched, "par", 10, max_tokens=3, n=3)    # 2 full prompt pages + 2 tokens
    out = run_step(sched, model)
    # Only sample 0 prefills; its siblings wait for its full pages.
    assert [(e.seq.sample_index, e.start_pos, e.num_new_tokens) for e in out.scheduled] == [(0, 0, 10)]
    out = run_step(sched, model)
    rows = [(e.seq.sample_index, e.start_pos, e.num_new_tokens) for e in out.scheduled]
    assert rows == [(0, 10, 1), (1, 8, 2), (2, 8, 2)]
    shared = seqs[0].page_ids[:2]
    assert seqs[1].page_ids[:2] == shared and seqs[2].page_ids[:2] == shared
    assert [sched.bm.refcount(p) for p in shared] == [3, 3]
    assert len({s.page_ids[2] for s in seqs}) == 3       # the partial page is private
    assert seqs[1].num_cached_tokens == 8
    while sched.has_unfinished():
        run_step(sched, model)
    assert_outputs_exact(seqs)
    assert len({tuple(s.output_token_ids) for s in seqs}) == 3
    assert_no_leak(sched)


def test_parallel_samples_with_short_prompt_start_together():
    sched, model = make(page_size=4)
    seqs = add(sched, "par", 3, max_tokens=2, n=4)     # no full page to share
    out = run_step(sched, model)
    assert sorted(e.seq.sample_index for e in out.scheduled) == [0, 1, 2, 3]
    while sched.has_unfinished():
        run_step(sched, model)
    assert_outputs_exact(seqs)
    assert_no_leak(sched)


def test_prefix_caching_skips_computed_pages():
    sched, model = make(page_size=4, budget=64, prefix_caching=True)
    prompt = list(range(1, 15))                           # 3 full pages + 2
    a = add(sched, "a", 0, max_tokens=2, prompt=prompt)[0]
    while sched.has_unfinished():
        run_step(sched, model)
    b = add(sched, "b", 0, max_tokens=2, prompt=prompt + [99])[0]
    out = run_step(sched, model)
    assert [(e.start_pos, e.num_new_tokens) for e in out.scheduled] == [(12, 3)]
    assert b.num_cached_tokens == 12
    while sched.has_unfinished():
        run_step(sched, model)
    assert_outputs_exact([a, b])
    assert sched.num_cached_tokens_total == 12
    assert_no_leak(sched)


def test_postprocess_needs_sampled_tokens_and_rejects_replays():
    sched, model = make()
    add(sched, "a", 4)
    out = sched.schedule()
    with pytest.raises(KeyError):
        sched.postprocess(out, {})
    sched2, _ = make()
    add(sched2, "a", 4)
    out = sched2.schedule()
    sampled = {e.seq.seq_id: 5 for e in out.scheduled}
    sched2.postprocess(out, sampled)
    with pytest.raises(RuntimeError):
        sched2.postprocess(out, sampled)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("cap", [0, 5])
@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_randomized_simulation(seed, prefix_caching, cap, overlap, policy):
    """``cap``: long_prefill_token_threshold (0: off); ``overlap``: the overlapped loop's
    order (commit at dispatch, resolve a step later); ``policy`` "priority": admission
    preempts lower-priority running sequences: every sequence still gets exactly its
    tokens, none past its limit, and every page comes back."""
    rng = random.Random(seed)
    ps = rng.choice([2, 4, 8])
    max_model_len = 96
    num_pages = rng.randrange(max_model_len // ps + 2, 3 * max_model_len // ps)
    sched, model = make(num_pages=num_pages, page_size=ps, max_num_seqs=rng.choice([2, 4, 8]),
                        budget=rng.choice([8, 16, 48]), max_model_len=max_model_len,
                        max_waiting=rng.choice([None, 12]), prefix_caching=prefix_caching, cap=cap,
                        policy=policy)
    shared_prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))] for _ in range(3)]
    all_seqs: list[Sequence] = []
    aborted: set[int] = set()
    in_flight: list = []
    n_req = 0
    for step in range(5000):
        if n_req < 60 and rng.random() < 0.3:
            rid = f"req{n_req}"
            plen = rng.randrange(1, 60)
            prompt = [rng.randrange(VOCAB) for _ in range(plen)]
            if rng.random() < 0.4:
                prompt = (rng.choice(shared_prefixes) + prompt)[:80]
            params = SamplingParams(n=rng.choice([1, 1, 1, 2, 3]), max_tokens=rng.randrange(1, 40))
            seqs = make_sequences(rid, prompt, params, priority=rng.choice([0, 0, 0, 1, -1]),
                                  arrival_time=float(step))
            waiting_before = list(sched.waiting)
            try:
                sched.add(seqs)
                all_seqs += seqs
            except QueueFullError:
                # refused only when it cannot fit, and refused whole: the queue is unchanged
                assert sched.max_waiting is not None
                assert len(waiting_before) + len(seqs) > sched.max_waiting
                assert sched.waiting == waiting_before
                assert all(s.status is SequenceStatus.WAITING and not s.page_ids for s in seqs)
            n_req += 1
        if all_seqs and rng.random() < 0.02:
            rid = rng.choice(all_seqs).request_id
            aborted.update(s.seq_id for s in sched.abort(rid))
        if n_req >= 60 and not sched.has_unfinished() and not in_flight:
            break
        if overlap:
            run_step_overlapped(sched, model, max_model_len, in_flight)
        else:
            run_step(sched, model, max_model_len)
        check_refcounts(sched, all_seqs)
    else:
        pytest.fail("simulation did not drain: a request starved")
    for s in all_seqs:
        assert s.status is SequenceStatus.FINISHED
        if s.seq_id in aborted:
            assert s.finish_reason == "abort" and s.page_ids == []
            continue
        assert s.finish_reason == "length"
        want = min(s.params.max_tokens, max(max_model_len - s.num_prompt_tokens, 1))
        assert s.num_output_tokens == want, s
    assert_outputs_exact(all_seqs)
    assert len(all_seqs) >= 20
    assert_no_leak(sched)


def check_refcounts(sched: Scheduler, seqs: list[Sequence]) -> None:
    sched.bm.check_invariants()
    held = Counter(p for s in seqs for p in s.page_ids)
    for s in seqs:
        if s.status is not SequenceStatus.RUNNING:
            assert s.page_ids == []
    for p in range(sched.bm.num_pages):
        assert sched.bm.refcount(p) == held.get(p, 0)


def test_host_modules_never_import_jax():
    code = ("import sys\n"
            "import jaxinfer.engine.sequence, jaxinfer.engine.block_manager\n"
            "import jaxinfer.engine.scheduler, jaxinfer.engine.detokenizer, jaxinfer.engine.admission\n"
            "bad = [m for m in ('jax', 'jaxlib', 'flax') if m in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_schedule_decode_run_bounds_pages_and_waiting():
    """Multi-step decode runs (num_scheduler_steps): only when every running sequence
    decodes and nobody could be admitted; k stops at the first max_tokens / max_model_len;
    pages for all k positions are allocated up front, all or nothing."""
    bm = BlockManager(num_pages=12, page_size=4)
    s = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=40)
    model = FakeModel(bm)
    a = make_sequences("a", [1, 2, 3], SamplingParams(max_tokens=6))[0]
    s.add(a)
    assert s.schedule_decode_run(8) is None                  # a must prefill first
    out = s.schedule()
    s.postprocess(out, model.step(out))                      # a: 1 output, decoding now
    run = s.schedule_decode_run(8)
    assert run is not None and run[1] == 5                   # max_tokens 6, one already out
    out, k = run
    assert [e.seq for e in out.scheduled] == [a] and out.scheduled[0].num_new_tokens == 1
    assert len(a.page_ids) * 4 >= a.num_computed_tokens + k  # pages for all k positions
    assert s.schedule_decode_run(1) is None                  # k < 2: single steps
    # Nothing could change (a computed nothing since): a second call asks for no new pages.
    free = bm.num_free_pages
    assert s.schedule_decode_run(8) is not None and bm.num_free_pages == free

    b = make_sequences("b", [4, 5], SamplingParams(max_tokens=30))[0]
    s.add(b)
    assert s.schedule_decode_run(8) is None                  # b waits and could be admitted
    out = s.schedule()
    s.postprocess(out, model.step(out))
    c = make_sequences("c", [6], SamplingParams(max_tokens=30))[0]
    s.add(c)                                                 # max_num_seqs=2 running: c cannot join
    run = s.schedule_decode_run(3)
    assert run is not None and run[1] == 3 and {e.seq for e in run[0].scheduled} == {a, b}

    # All or nothing: without free pages for every sequence's k positions, None and no change.
    bm2 = BlockManager(num_pages=6, page_size=4)             # 5 usable pages
    s2 = Scheduler(bm2, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=40)
    m2 = FakeModel(bm2)
    for rid in ("x", "y"):
        s2.add(make_sequences(rid, [1, 2, 3], SamplingParams(max_tokens=18)))
    out = s2.schedule()
    s2.postprocess(out, m2.step(out))
    pages = {q.seq_id: list(q.page_ids) for q in s2.running}
    assert bm2.num_free_pages == 3
    assert s2.schedule_decode_run(8) is None                 # needs 2 more pages each
    assert {q.seq_id: list(q.page_ids) for q in s2.running} == pages
    bm2.check_invariants()


def test_prefill_shapes_pack_prompts_and_every_step_fits_a_bucket():
    """With bucket shapes (slots, chunk) the scheduler packs several prompts into a step as
    long as their pieces (ceil(len / chunk) each) fit one shape, and the batch builder then
    finds that bucket and cuts each chunk into consecutive slots: the pieces cover the
    chunk's tokens in order, each with the KV length up to its own end, and only the last
    piece samples. Random prompts and arrivals: every step builds, nothing is lost."""
    from jaxinfer.engine.batch import BucketLadders, build_step, pieces

    shapes = ((1, 48), (3, 8), (6, 16))
    ladders = BucketLadders((1, 2, 4, 8), (0, 8), shapes, (64,))
    bm = BlockManager(256, 4)
    sched = Scheduler(bm, 8, 96, 256, prefill_shapes=shapes)
    model = FakeModel(bm)
    rng = random.Random(3)
    seqs = []
    for i in range(30):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.choice([2, 5, 9, 17, 40, 90]))]
        seqs += make_sequences(f"r{i}", prompt, SamplingParams(max_tokens=rng.choice([1, 3, 8])))
    pending, packed = list(seqs), 0
    rows = {}
    while pending or sched.has_unfinished():
        for _ in range(rng.randrange(4)):
            if pending:
                sched.add(pending.pop(0))
        out = sched.schedule()
        chunks = [e.num_new_tokens for e in out.scheduled if e.num_new_tokens > 1]
        assert any(pieces(chunks, c) <= n for n, c in shapes), chunks
        packed = max(packed, len(chunks))
        for e in out.scheduled:
            rows.setdefault(e.seq.seq_id, len(rows) + 1)
        b = build_step(out.scheduled, ladders, 4, rows)
        ps, c = b.bucket.num_decode, b.bucket.prefill_chunk
        for slot, e in b.entries:          # the last piece (or the decode slot) samples
            assert b.logits_index[slot] == (slot if slot < ps else ps + (slot - ps) * c + b.q_lens[slot] - 1)
            assert b.kv_lens[slot] == e.start_pos + e.num_new_tokens
        sampling = {slot for slot, _ in b.entries}
        covered: dict[int, list[int]] = {}
        for slot in range(ps, b.bucket.num_seqs):
            n = int(b.q_lens[slot])
            if n == 0:
                continue
            first = ps + (slot - ps) * c
            pos = b.positions[first:first + n]
            assert list(pos) == list(range(b.kv_lens[slot] - n, b.kv_lens[slot]))
            seq_row = int(b.rows[slot])
            covered.setdefault(seq_row, []).extend(int(p) for p in pos)
            assert b.reset_rows[slot] == (pos[0] == 0)
        for e in out.scheduled:
            if e.num_new_tokens > 1:
                assert covered[rows[e.seq.seq_id]] == list(range(e.start_pos, e.start_pos + e.num_new_tokens))
        assert len(sampling) == len(out.scheduled)
        sampled = model.step(out)
        for seq in sched.postprocess(out, sampled):
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
    assert packed >= 3, "the test meant several prompts per step"
    for seq in seqs:
        assert seq.output_token_ids == [expected_token(seq, j) for j in range(seq.params.max_tokens)]
    assert bm.num_free_pages == bm.num_usable_pages


def test_min_sampler_rows_gives_one_sampler_width():
    """EngineConfig.min_sampler_rows: every bucket's sampler rows are at least that many
    (num_seqs rounded up to a power of two otherwise), in the ladder and in the buckets
    ``choose`` returns, so a step's sampler input has that width; below 1: refused."""
    from jaxinfer.engine_config import EngineConfig
    from jaxinfer.engine.batch import BucketLadders, build_step

    shapes = ((4, 16),)
    plain = BucketLadders((1, 8), (0, 8), shapes, (16,))
    assert sorted({b.sample_rows for b in plain.all_buckets()}) == [1, 4, 8, 16]
    one = BucketLadders((1, 8), (0, 8), shapes, (16,), min_sample_rows=16)
    assert {b.sample_rows for b in one.all_buckets()} == {16}
    assert one.choose(1, [], 3).sample_rows == 16 and plain.choose(1, [], 3).sample_rows == 1
    assert one.choose(0, [5], 3) in one.all_buckets()
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, 8, 64, 64)
    for s in make_sequences("r0", [5, 6, 7], SamplingParams(max_tokens=2)):
        sched.add(s)
    scheduled = sched.schedule().scheduled
    b = build_step(scheduled, one, 4, {e.seq.seq_id: 1 for e in scheduled})
    assert b.bucket.sample_rows == 16
    with pytest.raises(ValueError, match="min_sampler_rows"):
        EngineConfig(min_sampler_rows=0)
    from jaxinfer.engine_args import engine_config
    from serving.cli import build_parser

    assert engine_config(build_parser().parse_args(["serve"]), 32).min_sampler_rows is None
    args = build_parser().parse_args(["serve", "--min-sampler-rows", "32"])
    assert engine_config(args, 32).min_sampler_rows == 32


@pytest.mark.parametrize("max_num_seqs", [1, 2, 8, 32, 64])
@pytest.mark.parametrize("budget", [32, 64, 100, 512, 2048])
def test_default_prefill_shapes_pad_a_prompt_at_most_twice(max_num_seqs, budget):
    """The default ladder's cheapest bucket for one prompt chunk of any length the budget
    allows holds at most twice its positions (32 at least): no gap like the old 128 -> 512
    single slots, where a 129-token prompt paid for 512 (benchmarks/RESULTS.md, "Prefill
    shapes"); a one-sequence engine's shapes have one slot (its sampler stays one row)."""
    from jaxinfer.engine.batch import default_ladders

    lad = default_ladders(max_num_seqs, 4096, 16, budget)
    if max_num_seqs == 1:
        assert {n for n, _ in lad.prefill_shapes} == {1}
    for n in range(1, min(budget, 512) + 1):
        b = lad.choose(0, [n], 1)
        assert b.num_prefill * b.prefill_chunk <= max(32, 2 * n), (n, b)


# ---- long prefills (long_prefill_token_threshold) ------------------------------------

def chunk_of(out: SchedulerOutput, seq: Sequence) -> int:
    """Tokens ``seq`` computes in this step (0: not scheduled)."""
    return sum(e.num_new_tokens for e in out.scheduled if e.seq is seq)


def run_long_beside_short(cap: int) -> tuple[list[int], int, int]:
    """A 400-token prompt prefills alone for a step, then a 10-token one arrives -> (the
    long one's chunk per step, the step the short one finished, the step the long one got
    its first token)."""
    sched, model = make(budget=64, max_model_len=512, num_pages=160, cap=cap)
    (long,) = add(sched, "long", 400, max_tokens=2)
    chunks, short_done, long_first = [], None, None
    short = None
    step = 0
    while sched.has_unfinished():
        out = run_step(sched, model)
        step += 1
        chunks.append(chunk_of(out, long))
        if short is None:
            (short,) = add(sched, "short", 10, max_tokens=4)
        if short_done is None and short.status is SequenceStatus.FINISHED:
            short_done = step
        if long_first is None and long.num_output_tokens:
            long_first = step
    assert_outputs_exact([long, short])
    assert_no_leak(sched)
    return chunks, short_done, long_first


def test_a_long_prefill_is_capped_so_a_short_request_arriving_runs_at_once():
    """From the step after the short request arrives, the long prompt's chunk is cut to the
    threshold and the short one is admitted with the budget it left: it prefills, decodes
    and finishes while the long one is still prefilling, and the long one computes a chunk
    every step, back to the whole budget once it is alone again. Without the cap, the short
    one waits for the whole 400-token prefill."""
    chunks, short_done, long_first = run_long_beside_short(cap=16)
    # step 1 alone: 64; steps 2-5 beside the short one (admitted at step 2, 4 tokens): 16
    assert chunks[:6] == [64, 16, 16, 16, 16, 64]
    assert short_done == 5 < long_first
    assert all(chunks[:long_first])                       # the long one progressed every step

    chunks, short_done, long_first = run_long_beside_short(cap=0)
    assert chunks[:7] == [64] * 6 + [16] and short_done > long_first


def test_a_lone_long_prompt_is_not_capped():
    """Alone, or with only its own ``n`` samples waiting for its prompt pages, or beside a
    request that has no seat (it could not run this step anyway), a prompt prefills at the
    whole budget."""
    sched, model = make(budget=64, max_model_len=512, num_pages=160, cap=16)
    (seq,) = add(sched, "alone", 300, max_tokens=1)
    assert [chunk_of(run_step(sched, model), seq) for _ in range(5)] == [64, 64, 64, 64, 44]

    sched, model = make(budget=64, max_model_len=512, num_pages=200, cap=16)
    first, *others = add(sched, "n3", 300, max_tokens=1, n=3)
    assert [chunk_of(run_step(sched, model), first) for _ in range(4)] == [64, 64, 64, 64]

    sched, model = make(budget=64, max_model_len=512, num_pages=160, cap=16, max_num_seqs=1)
    (seq,) = add(sched, "seated", 300, max_tokens=1)
    add(sched, "no-seat", 5, max_tokens=1)
    assert [chunk_of(run_step(sched, model), seq) for _ in range(3)] == [64, 64, 64]


def test_a_long_prompt_arriving_beside_decodes_is_capped_at_admission():
    """Admission cuts the first chunk too: a long prompt that arrives while another request
    decodes starts with the threshold, not the budget left, and the decode stays in the step."""
    sched, model = make(budget=64, max_model_len=512, num_pages=160, cap=16)
    (dec,) = add(sched, "decoding", 4, max_tokens=50)
    run_step(sched, model)
    (long,) = add(sched, "long", 200, max_tokens=1)
    out = run_step(sched, model)
    assert (chunk_of(out, dec), chunk_of(out, long)) == (1, 16)


def test_the_long_prefill_progresses_under_a_stream_of_short_requests():
    """A short request arriving every step keeps the engine shared for the whole prefill:
    the long prompt still gets its capped chunk every step (running sequences are served
    before admission), and every request ends with exactly its tokens."""
    sched, model = make(budget=32, max_model_len=512, num_pages=200, cap=8, max_num_seqs=16)
    (long,) = add(sched, "long", 240, max_tokens=2)
    seqs = [long]
    for i in range(60):
        if long.num_output_tokens:
            break
        seqs += add(sched, f"s{i}", 6, max_tokens=3)
        left = long.num_prompt_tokens - long.num_computed_tokens
        assert chunk_of(run_step(sched, model), long) == min(8, left)
    else:
        pytest.fail("the long prompt starved")
    while sched.has_unfinished():
        run_step(sched, model)
    assert_outputs_exact(seqs)
    assert_no_leak(sched)


@pytest.mark.parametrize("shapes, threshold, cap", [
    (((1, 32), (2, 32), (4, 32)), 20, 32),         # slots of 32: whole slots
    (((1, 32), (2, 32), (4, 32)), 40, 64),
    (((1, 32), (1, 64), (1, 128)), 100, 128),      # one-slot shapes (max_num_seqs 1)
    (((1, 32), (2, 32), (4, 32)), 0, 0),           # off
])
def test_the_cap_is_whole_prefill_slots_and_every_step_fits_a_bucket(shapes, threshold, cap):
    """The threshold is rounded up to whole slots of the narrowest compiled chunk (a chunk
    pads to whole slots: the rest of the slot would compute nothing); a long prompt with
    short ones arriving beside it: every step's chunks fit one compiled shape and build."""
    from jaxinfer.engine.batch import BucketLadders, build_step, pieces

    sched, model = make(budget=128, max_model_len=1024, num_pages=400, cap=threshold, prefill_shapes=shapes)
    assert sched.long_prefill_cap == cap
    ladders = BucketLadders((1, 2, 4, 8), (0, 8), shapes, (256,))
    (long,) = add(sched, "long", 700, max_tokens=2)
    seqs, rows = [long], {}
    for i in range(200):
        if i < 12:
            seqs += add(sched, f"s{i}", 3 + 7 * i, max_tokens=3)
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        chunks = [e.num_new_tokens for e in out.scheduled if e.num_new_tokens > 1]
        assert any(pieces(chunks, c) <= n for n, c in shapes), chunks
        if cap and len(out.scheduled) > 1:                # shared: the long one is capped
            assert chunk_of(out, long) <= cap
        for e in out.scheduled:
            rows.setdefault(e.seq.seq_id, len(rows) + 1)
        build_step(out.scheduled, ladders, 4, rows)
        for seq in sched.postprocess(out, model.step(out)):
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
    assert_outputs_exact(seqs)
    assert_no_leak(sched)


def test_long_prefill_token_threshold_is_validated_and_resolved():
    """EngineConfig / the scheduler refuse a negative or non-integer threshold; None (auto)
    resolves to a sixteenth of the budget; the CLI flag reaches the config."""
    from jaxinfer.engine.scheduler import long_prefill_threshold
    from jaxinfer.engine_args import engine_config
    from jaxinfer.engine_config import EngineConfig
    from serving.cli import build_parser

    for bad in (-1, True, 1.5, "64"):
        with pytest.raises(ValueError, match="long_prefill_token_threshold"):
            EngineConfig(long_prefill_token_threshold=bad)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        make(cap=-1)
    assert long_prefill_threshold(None, 512) == 32 and long_prefill_threshold(None, 8) == 1
    assert long_prefill_threshold(0, 512) == 0 and long_prefill_threshold(300, 512) == 300
    assert engine_config(build_parser().parse_args(["serve"]), 32).long_prefill_token_threshold is None
    args = build_parser().parse_args(["serve", "--long-prefill-token-threshold", "0"])
    assert engine_config(args, 32).long_prefill_token_threshold == 0

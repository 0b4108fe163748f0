"""BlockManager: allocation, refcounts, sharing, prefix caching, no page leaks (host only)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.sequence import Sequence, next_seq_id


def mkseq(prompt: list[int], outputs: list[int] | None = None) -> Sequence:
    return Sequence(seq_id=next_seq_id(), request_id=f"r{next_seq_id()}", prompt_token_ids=list(prompt),
                    params=SamplingParams(), output_token_ids=list(outputs or []))


def check(bm: BlockManager, live: list[Sequence]) -> None:
    """Pool invariants, and refcounts equal to how many live sequences list each page."""
    bm.check_invariants()
    held = Counter(p for s in live for p in s.page_ids)
    for p in range(bm.num_pages):
        assert bm.refcount(p) == held.get(p, 0), f"page {p}"
    assert bm.num_free_pages + bm.num_used_pages == bm.num_pages - 1
    assert bm.num_used_pages == len(held)


def test_page_zero_is_never_handed_out_and_all_or_nothing():
    bm = BlockManager(num_pages=5, page_size=4)
    a = mkseq(range(10))
    assert bm.pages_for(10) == 3 and bm.pages_for(0) == 0 and bm.pages_for(4) == 1
    assert bm.allocate_for(a, 10)
    assert len(a.page_ids) == 3 and 0 not in a.page_ids
    assert bm.num_free_pages == 1 and bm.num_used_pages == 3 and bm.usage == pytest.approx(0.75)
    # Growing within the last page needs nothing; past it needs one more page.
    assert bm.allocate_for(a, 12) and len(a.page_ids) == 3
    b = mkseq(range(9))
    assert not bm.can_allocate(3)
    assert not bm.allocate_for(b, 9)          # needs 3, only 1 free: nothing taken
    assert b.page_ids == [] and bm.num_free_pages == 1
    assert bm.allocate_for(b, 4)
    assert not bm.allocate_for(a, 13)         # pool empty: a unchanged
    assert len(a.page_ids) == 3
    check(bm, [a, b])
    bm.free(a)
    bm.free(b)
    assert a.page_ids == [] and bm.num_free_pages == 4 and bm.usage == 0
    check(bm, [])


def test_share_refcounts():
    bm = BlockManager(num_pages=9, page_size=4)
    src = mkseq(range(10))
    dst = mkseq(range(10))
    assert bm.allocate_for(src, 10)
    bm.share(src, dst, 2)
    assert dst.page_ids == src.page_ids[:2]
    assert [bm.refcount(p) for p in src.page_ids] == [2, 2, 1]
    assert bm.allocate_for(dst, 10)           # its own third page
    assert dst.page_ids[2] != src.page_ids[2]
    check(bm, [src, dst])
    bm.free(src)                              # shared pages survive their first owner
    assert [bm.refcount(p) for p in dst.page_ids] == [1, 1, 1]
    check(bm, [dst])
    bm.free(dst)
    check(bm, [])
    assert bm.num_free_pages == 8
    with pytest.raises(ValueError):
        bm.share(src, dst, 1)                 # src holds nothing any more
    with pytest.raises(ValueError):
        BlockManager(num_pages=1, page_size=4)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_random_operations_keep_invariants(prefix_caching):
    rng = random.Random(1234 + prefix_caching)
    ps = 4
    bm = BlockManager(num_pages=24, page_size=ps, enable_prefix_caching=prefix_caching)
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    live: list[Sequence] = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 or not live:             # new sequence, maybe from a cached prefix
            s = mkseq(rng.choice(prompts))
            prefix = bm.lookup_prefix(s)
            assert len(prefix) * ps < s.num_tokens      # a hit leaves >= 1 token to compute
            total = rng.randrange(len(prefix) * ps + 1, s.num_tokens + 1)
            if bm.allocate_for(s, total, prefix_pages=prefix):
                s.num_computed_tokens = total if rng.random() < 0.7 else len(prefix) * ps
                bm.cache_computed(s)
                live.append(s)
            else:
                assert s.page_ids == []
        elif op < 0.6:                        # grow: decode / next chunk
            s = rng.choice(live)
            s.output_token_ids.append(rng.randrange(50))
            if bm.allocate_for(s, s.num_tokens):
                s.num_computed_tokens = s.num_tokens
                bm.cache_computed(s)
        elif op < 0.7:                        # n>1 style share of full computed pages
            src = rng.choice(live)
            k = min(src.num_computed_tokens // ps, len(src.page_ids))
            dst = mkseq(src.prompt_token_ids)
            bm.share(src, dst, k)
            dst.num_computed_tokens = k * ps
            live.append(dst)
        else:
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        check(bm, live)
    for s in live:
        bm.free(s)
    check(bm, [])
    assert bm.num_free_pages == bm.num_usable_pages and bm.num_used_pages == 0


def test_prefix_cache_hit_evict_and_reuse():
    ps = 4
    bm = BlockManager(num_pages=8, page_size=ps, enable_prefix_caching=True)
    prompt = list(range(100, 111))            # 11 tokens: 2 full pages + 3
    a = mkseq(prompt)
    assert bm.lookup_prefix(a) == []
    assert bm.allocate_for(a, 11)
    a.num_computed_tokens = 11
    bm.cache_computed(a)
    assert bm.num_cached_pages == 2           # the partial page is never cached
    # A second request with the same prompt, while a is running: shared pages.
    b = mkseq(prompt)
    hit = bm.lookup_prefix(b)
    assert hit == a.page_ids[:2]
    assert bm.allocate_for(b, 11, prefix_pages=hit)
    assert [bm.refcount(p) for p in hit] == [2, 2]
    check(bm, [a, b])
    bm.free(a)
    bm.free(b)
    # Freed but cached: evictable, counted as free, still found.
    assert bm.num_free_pages == 7 and bm.num_cached_pages == 2
    c = mkseq(prompt[:8] + [7, 7, 7])
    hit = bm.lookup_prefix(c)
    assert len(hit) == 2
    assert bm.allocate_for(c, 11, prefix_pages=hit)
    c.num_computed_tokens = 11
    check(bm, [c])
    bm.free(c)
    # Exactly two full pages of prompt: the hit must leave a token to compute.
    d = mkseq(prompt[:8])
    assert len(bm.lookup_prefix(d)) == 1
    # A different first page breaks the chain even if page 2 matches.
    e = mkseq([0, 0, 0, 0] + prompt[4:8] + [1])
    assert bm.lookup_prefix(e) == []
    # Fill the pool: cached pages are evicted (last page of a prefix first), then gone.
    assert bm.num_free_pages == 7             # 5 on the free list + 2 evictable
    f = mkseq([9] * 16)
    assert bm.allocate_for(f, 16)             # 4 pages, all from the free list
    assert bm.num_cached_pages == 2
    g = mkseq([8] * 4)
    assert bm.allocate_for(g, 4)              # the last plain free page
    assert bm.num_cached_pages == 2
    h = mkseq([6] * 4)
    assert bm.allocate_for(h, 1)              # free list empty: evicts the LRU cached page
    assert bm.num_cached_pages == 1
    assert len(bm.lookup_prefix(mkseq(prompt))) == 1   # the prefix's first page survived
    check(bm, [f, g, h])
    for s in (f, g, h):
        bm.free(s)
    bm.reset_prefix_cache()
    assert bm.num_cached_pages == 0 and bm.lookup_prefix(mkseq(prompt)) == []
    check(bm, [])


def test_prefix_caching_off_caches_nothing():
    bm = BlockManager(num_pages=8, page_size=4)
    a = mkseq(range(12))
    assert bm.allocate_for(a, 12)
    a.num_computed_tokens = 12
    bm.cache_computed(a)
    assert bm.num_cached_pages == 0 and bm.lookup_prefix(mkseq(range(12))) == []


def test_hit_pages_are_not_evicted_by_the_same_allocation():
    # The only free pages are the cached ones we want to reuse: the allocation must
    # count them as taken, not evict them to satisfy its own fresh pages.
    ps = 2
    bm = BlockManager(num_pages=4, page_size=ps, enable_prefix_caching=True)
    a = mkseq([1, 2, 3, 4, 5])
    assert bm.allocate_for(a, 5)
    a.num_computed_tokens = 5
    bm.cache_computed(a)
    bm.free(a)                                # 2 evictable + 1 free
    b = mkseq([1, 2, 3, 4, 5, 6, 7, 8, 9])    # hit 2 pages, needs 3 more: only 1 left
    hit = bm.lookup_prefix(b)
    assert len(hit) == 2
    assert not bm.allocate_for(b, 9, prefix_pages=hit)
    assert b.page_ids == [] and bm.num_cached_pages == 2
    check(bm, [])
    assert bm.allocate_for(b, 6, prefix_pages=hit)
    assert b.page_ids[:2] == hit
    check(bm, [b])

"""Host-side page allocator for the paged KV cache (no jax).

The device cache is ``num_pages`` pages of ``page_size`` token slots. Page 0 is the
padding sink: padded rows of a batch write their KV there and read nothing from it, so it
is never handed out. The other ``num_pages - 1`` pages are usable.

Every usable page is in exactly one place at any time:

- held: ``refcount > 0`` (one count per sequence whose ``page_ids`` list it);
- free: refcount 0 and no cached content, on the free list;
- evictable (prefix caching only): refcount 0 but it holds a full page of computed KV
  that is registered under its chain hash; it is reused on a hit, or evicted (least
  recently freed first) when the free list runs dry.

``num_free_pages`` counts free + evictable: both can be handed out at once.

Sharing: a full page (all ``page_size`` slots computed) is never written again, so
several sequences may list it (``share``, prefix-cache hits). A partially filled page is
always private to one sequence.

Prefix caching (``enable_prefix_caching=True``): the hash of page ``i`` of a sequence is
``hash((hash of page i-1, tokens of page i))``, so equal hashes mean equal prefixes up
to 64-bit collisions; a hit also compares the page's tokens, so a wrong hit needs a
collision on the whole earlier prefix and identical tokens. Pages are registered once
their KV is computed (``cache_computed``, called after the step), never earlier, because
a hit must read KV that already exists.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as _Seq

from jaxinfer.engine.sequence import Sequence

# A fixed int (not hash of a str, which PYTHONHASHSEED randomizes) so hashes are reproducible.
_ROOT_HASH = 0x6A6178696E666572


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = False) -> None:
        if not (isinstance(num_pages, int) and num_pages >= 2):
            raise ValueError(f"num_pages: must be an integer >= 2 (page 0 is reserved), got {num_pages!r}")
        if not (isinstance(page_size, int) and page_size >= 1):
            raise ValueError(f"page_size: must be a positive integer, got {page_size!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refcount = [0] * num_pages
        # A stack: reversed so that page 1 is handed out first (deterministic, readable tests).
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()   # least recently freed first
        self._hash_to_page: dict[int, int] = {}
        self._page_hash: dict[int, int] = {}
        self._page_tokens: dict[int, tuple[int, ...]] = {}
        self._num_registered: dict[int, int] = {}                  # seq_id -> pages checked

    # ---- counts -------------------------------------------------------------------
    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - self.num_free_pages

    @property
    def usage(self) -> float:
        """Fraction of usable pages held by sequences (evictable cached pages count as free)."""
        return self.num_used_pages / self.num_usable_pages

    @property
    def num_cached_pages(self) -> int:
        """Pages registered in the prefix cache (held or evictable)."""
        return len(self._page_hash)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, n_pages: int) -> bool:
        return n_pages <= self.num_free_pages

    # ---- allocation ---------------------------------------------------------------
    def allocate_for(self, seq: Sequence, num_tokens_total: int,
                     prefix_pages: _Seq[int] = ()) -> bool:
        """Grow ``seq.page_ids`` to cover ``num_tokens_total`` token slots; all or nothing.

        ``prefix_pages`` (only for a sequence holding no pages yet) are full, computed
        pages to reuse as its first pages: a sibling's prompt pages or prefix-cache hits.
        They are taken by reference (refcount + 1), the rest come from the free pool.
        Returns False, changing nothing, if the free pool is too small.
        """
        if prefix_pages and seq.page_ids:
            raise ValueError(f"prefix_pages given for {seq!r}, which already holds pages")
        extra = self.pages_for(num_tokens_total) - len(seq.page_ids) - len(prefix_pages)
        # Evictable prefix pages leave the free pool when taken, so they don't count.
        reclaimed = sum(1 for p in prefix_pages if self._refcount[p] == 0)
        if max(extra, 0) > self.num_free_pages - reclaimed:
            return False
        for p in prefix_pages:            # before taking fresh pages: they must not be evicted
            self._incref(p)
        seq.page_ids.extend(prefix_pages)
        for _ in range(extra):
            p = self._take_free_page()
            self._refcount[p] = 1
            seq.page_ids.append(p)
        return True

    def share(self, src_seq: Sequence, dst_seq: Sequence, num_pages: int) -> None:
        """Make ``dst_seq`` (holding no pages) start with ``src_seq``'s first ``num_pages``.

        The caller guarantees those pages are full and computed (they will never be
        written again); refcounts go up by one.
        """
        if dst_seq.page_ids:
            raise ValueError(f"share: destination {dst_seq!r} already holds pages")
        if not 0 <= num_pages <= len(src_seq.page_ids):
            raise ValueError(f"share: num_pages={num_pages} but source holds {len(src_seq.page_ids)}")
        pages = src_seq.page_ids[:num_pages]
        for p in pages:
            self._incref(p)
        dst_seq.page_ids.extend(pages)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s reference to each of its pages; pages at refcount 0 become free.

        Freed in reverse so that, in the evictable LRU, a sequence's last pages are
        evicted before its first ones (prefixes are the likelier hits).
        """
        for p in reversed(seq.page_ids):
            self._decref(p)
        seq.page_ids = []
        self._num_registered.pop(seq.seq_id, None)

    # ---- prefix caching -----------------------------------------------------------
    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """The longest run of cached pages matching ``seq``'s first full pages.

        Leaves at least one token to compute (the step must produce logits for the last
        token), so at most ``(num_tokens - 1) // page_size`` pages. Changes nothing; pass
        the result to ``allocate_for(..., prefix_pages=...)``. ``[]`` when disabled.
        """
        if not self.enable_prefix_caching:
            return []
        max_pages = (seq.num_tokens - 1) // self.page_size
        hashes = self._hashes(seq, max_pages)
        pages: list[int] = []
        ps = self.page_size
        for i in range(max_pages):
            p = self._hash_to_page.get(hashes[i])
            if p is None or self._page_tokens[p] != tuple(seq.token_ids_slice(i * ps, (i + 1) * ps)):
                break
            pages.append(p)
        return pages

    def cache_computed(self, seq: Sequence) -> None:
        """Register ``seq``'s newly full, computed pages in the prefix cache (after a step)."""
        if not self.enable_prefix_caching:
            return
        n_full = min(seq.num_computed_tokens // self.page_size, len(seq.page_ids))
        start = self._num_registered.get(seq.seq_id, 0)
        if n_full <= start:
            return
        hashes = self._hashes(seq, n_full)
        ps = self.page_size
        for i in range(start, n_full):
            p, h = seq.page_ids[i], hashes[i]
            # Skip pages already registered (hits, shared pages) and duplicates of content
            # another page already caches: that page stays the canonical copy.
            if p in self._page_hash or h in self._hash_to_page:
                continue
            self._hash_to_page[h] = p
            self._page_hash[p] = h
            self._page_tokens[p] = tuple(seq.token_ids_slice(i * ps, (i + 1) * ps))
        self._num_registered[seq.seq_id] = n_full

    def reset_prefix_cache(self) -> None:
        """Forget every cached page that no sequence holds (e.g. after new weights)."""
        while self._evictable:
            p, _ = self._evictable.popitem(last=False)
            self._unregister(p)
            self._free.append(p)
        for p in list(self._page_hash):
            self._unregister(p)   # held pages stay held, just no longer findable
        self._num_registered.clear()

    # ---- checks -------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the pools and refcounts disagree (tests call this)."""
        free, evict = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "duplicate page on the free list"
        assert 0 not in free and 0 not in evict and self._refcount[0] == 0, "page 0 was handed out"
        assert not (free & evict), f"pages both free and evictable: {sorted(free & evict)}"
        for p in range(1, self.num_pages):
            rc = self._refcount[p]
            assert rc >= 0, f"page {p} has refcount {rc}"
            where = (rc > 0) + (p in free) + (p in evict)
            assert where == 1, f"page {p} (refcount {rc}) is in {where} places"
        assert self.num_free_pages + self.num_used_pages == self.num_usable_pages
        assert all(p in self._page_hash for p in evict), "evictable page without a hash"
        assert not any(p in self._page_hash for p in free), "free page still registered"
        assert len(self._hash_to_page) == len(self._page_hash) == len(self._page_tokens)
        for h, p in self._hash_to_page.items():
            assert self._page_hash[p] == h, f"hash table and page {p} disagree"

    # ---- internals ----------------------------------------------------------------
    def _take_free_page(self) -> int:
        if self._free:
            return self._free.pop()
        p, _ = self._evictable.popitem(last=False)   # evict the least recently freed
        self._unregister(p)
        return p

    def _incref(self, p: int) -> None:
        if self._refcount[p] == 0:
            if p not in self._evictable:
                raise ValueError(f"page {p} is free: it holds no KV to share")
            del self._evictable[p]
        self._refcount[p] += 1

    def _decref(self, p: int) -> None:
        rc = self._refcount[p] - 1
        if rc < 0:
            raise ValueError(f"page {p} freed more often than it was taken")
        self._refcount[p] = rc
        if rc == 0:
            if p in self._page_hash:
                self._evictable[p] = None
            else:
                self._free.append(p)

    def _unregister(self, p: int) -> None:
        h = self._page_hash.pop(p)
        del self._hash_to_page[h]
        del self._page_tokens[p]

    def _hashes(self, seq: Sequence, num_pages: int) -> list[int]:
        """``seq.page_hashes`` extended to cover its first ``num_pages`` (full) pages."""
        hs, ps = seq.page_hashes, self.page_size
        while len(hs) < num_pages:
            i = len(hs)
            parent = hs[-1] if hs else _ROOT_HASH
            hs.append(hash((parent, tuple(seq.token_ids_slice(i * ps, (i + 1) * ps)))))
        return hs

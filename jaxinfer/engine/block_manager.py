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
a hit must read KV that already exists. A request's ``cache_salt`` seeds its chain, so
requests with different salts never share pages.

Eviction order: the evictable pool is least recently freed first, and a sequence frees its
pages last-first, so a prefix's leaves are evicted before their parents. A parent's
refcount is never below its child's (whoever holds a page holds its whole prefix), so a
parent never becomes evictable before its children.

Host tier (``num_host_pages > 0``): a cached page evicted from the device is first copied
to a host slot (engine/host_page_index.py), and a lookup that misses on the device but
hits on the host returns a ``HostPage``; ``allocate_for`` gives it a fresh device page
and copies it back. This module only decides: every copy is queued as a ``PageOp`` in
the order it was decided, and the engine hands them to the runner (``take_page_ops``)
before the step's forward reads any page. ``record_freed=True`` (tests) also queues a
"poison" op for every page that loses its content (freed, or evicted), so a runner that
poisons them makes any read of a freed page show in the outputs.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence as _Seq
from typing import NamedTuple

from jaxinfer.engine.host_page_index import HostPage, HostPageIndex
from jaxinfer.engine.sequence import Sequence

# A fixed int (not hash of a str, which PYTHONHASHSEED randomizes) so hashes are reproducible.
_ROOT_HASH = 0x6A6178696E666572


class PageOp(NamedTuple):
    """One page move for the runner: "to_host" (device ``page`` -> host ``slot``),
    "to_device" (host ``slot`` -> device ``page``), "copy" (device page ``slot`` -> device
    ``page``) or "poison" (``page``; slot unused)."""

    kind: str
    page: int
    slot: int = -1


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = False,
                 num_host_pages: int = 0, record_freed: bool = False) -> None:
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
        self.host = HostPageIndex(num_host_pages if enable_prefix_caching else 0)
        self._pinned_slots: set[int] = set()     # host slots being read by the current allocation
        self.record_freed = record_freed
        self._ops: list[PageOp] = []

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

    @property
    def num_host_cached_pages(self) -> int:
        """Pages the host tier holds."""
        return len(self.host)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, n_pages: int) -> bool:
        return n_pages <= self.num_free_pages

    # ---- allocation ---------------------------------------------------------------
    def allocate_for(self, seq: Sequence, num_tokens_total: int,
                     prefix_pages: _Seq[int | HostPage] = ()) -> bool:
        """Grow ``seq.page_ids`` to cover ``num_tokens_total`` token slots; all or nothing.

        ``prefix_pages`` (only for a sequence holding no pages yet) are full, computed
        pages to reuse as its first pages: a sibling's prompt pages or prefix-cache hits
        (``lookup_prefix``). Device pages are taken by reference (refcount + 1); a
        ``HostPage`` gets a fresh page and a "to_device" op; the rest come from the free
        pool. Returns False, changing nothing, if the free pool is too small.
        """
        if prefix_pages and seq.page_ids:
            raise ValueError(f"prefix_pages given for {seq!r}, which already holds pages")
        on_device = [p for p in prefix_pages if not isinstance(p, HostPage)]
        extra = self.pages_for(num_tokens_total) - len(seq.page_ids) - len(on_device)
        # Evictable prefix pages leave the free pool when taken, so they don't count.
        reclaimed = sum(1 for p in on_device if self._refcount[p] == 0)
        if max(extra, 0) > self.num_free_pages - reclaimed:
            return False
        for p in on_device:               # before taking fresh pages: they must not be evicted
            self._incref(p)
        self._pinned_slots = {p.slot for p in prefix_pages if isinstance(p, HostPage)}
        for p in prefix_pages:
            if isinstance(p, HostPage):
                p = self._load_from_host(p.slot)
                extra -= 1
            seq.page_ids.append(p)
        self._pinned_slots = set()
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

    def fork(self, src: Sequence, dst: Sequence) -> bool:
        """``dst`` (holding no pages) starts with ``src``'s computed KV, copy-on-write
        (beam search): ``src``'s full pages are shared (refcount + 1) and its partially
        filled last page, which both will go on writing, is copied into a fresh page
        ("copy" op, run before the next forward). False, changing nothing, if no page is
        free for that copy."""
        if dst.page_ids:
            raise ValueError(f"fork: destination {dst!r} already holds pages")
        n = src.num_computed_tokens
        full, partial = divmod(n, self.page_size)
        if self.pages_for(n) > len(src.page_ids):
            raise ValueError(f"fork: {src!r} holds too few pages for its {n} computed tokens")
        if partial and not self.num_free_pages:
            return False
        for p in src.page_ids[:full]:
            self._incref(p)
        dst.page_ids.extend(src.page_ids[:full])
        dst.page_hashes = list(src.page_hashes[:full])
        if partial:
            p = self._take_free_page()
            self._refcount[p] = 1
            dst.page_ids.append(p)
            self._ops.append(PageOp("copy", p, src.page_ids[full]))
        return True

    def swap_pages(self, a: Sequence, b: Sequence) -> None:
        """Exchange the pages of two forks of one sequence (token-tree speculation: the
        parent takes the pages of the branch whose chain was accepted). Their full pages
        are the same pages (so each keeps its hashes and prefix-cache registrations);
        refcounts are unchanged."""
        a.page_ids, b.page_ids = b.page_ids, a.page_ids

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s reference to each of its pages; pages at refcount 0 become free.

        Freed in reverse so that, in the evictable LRU, a sequence's last pages are
        evicted before its first ones (prefixes are the likelier hits).
        """
        for p in reversed(seq.page_ids):
            self._decref(p)
        seq.page_ids = []
        self._num_registered.pop(seq.seq_id, None)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Drop ``seq``'s pages past the first ``pages_for(num_tokens)`` (speculative
        decoding: pages that held only rejected draft tokens' KV go back to the pool)."""
        keep = self.pages_for(num_tokens)
        for p in reversed(seq.page_ids[keep:]):
            self._decref(p)
        del seq.page_ids[keep:]

    # ---- prefix caching -----------------------------------------------------------
    def lookup_prefix(self, seq: Sequence) -> list[int | HostPage]:
        """The longest run of cached pages matching ``seq``'s first full pages: device
        page ids, or ``HostPage`` where only the host tier holds the page.

        Leaves at least one token to compute (the step must produce logits for the last
        token), so at most ``(num_tokens - 1) // page_size`` pages. Changes nothing; pass
        the result to ``allocate_for(..., prefix_pages=...)``. ``[]`` when disabled.
        """
        if not self.enable_prefix_caching:
            return []
        max_pages = (seq.num_tokens - 1) // self.page_size
        hashes = self._hashes(seq, max_pages)
        pages: list[int | HostPage] = []
        ps = self.page_size
        for i in range(max_pages):
            tokens = tuple(seq.token_ids_slice(i * ps, (i + 1) * ps))
            p = self._hash_to_page.get(hashes[i])
            if p is not None and self._page_tokens[p] == tokens:
                pages.append(p)
                continue
            slot = self.host.find(hashes[i], tokens) if self.host.num_slots else None
            if slot is None:
                break
            pages.append(HostPage(slot))
        return pages

    def take_page_ops(self) -> list[PageOp]:
        """The page moves decided since the last call, in order (the runner applies them
        before the next forward)."""
        ops, self._ops = self._ops, []
        return ops

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
            if self.record_freed:
                self._ops.append(PageOp("poison", p))
        for p in list(self._page_hash):
            self._unregister(p)   # held pages stay held, just no longer findable
        self._num_registered.clear()
        self.host.clear()

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
        self.host.check_invariants()

    # ---- internals ----------------------------------------------------------------
    def _take_free_page(self) -> int:
        if self._free:
            return self._free.pop()
        p, _ = self._evictable.popitem(last=False)   # evict the least recently freed
        self._save_to_host(p)
        self._unregister(p)
        if self.record_freed:
            self._ops.append(PageOp("poison", p))
        return p

    def _save_to_host(self, p: int) -> None:
        """Before device page ``p`` (cached) is reused: keep a host copy if the tier has room."""
        if not self.host.num_slots:
            return
        h = self._page_hash[p]
        if h in self.host:               # inclusive tier: already there (it came from the host)
            slot = self.host.find(h, self._page_tokens[p])
            if slot is not None:
                self.host.touch(slot)
            return
        slot = self.host.put(h, self._page_tokens[p], self._pinned_slots)
        if slot is not None:
            self._ops.append(PageOp("to_host", p, slot))

    def _load_from_host(self, slot: int) -> int:
        """A fresh device page (refcount 1) that will hold host ``slot``'s KV, registered
        in the device cache at once: the copy runs before any forward can read it."""
        h, tokens = self.host.entry(slot)
        self.host.touch(slot)
        p = self._take_free_page()
        self._refcount[p] = 1
        self._ops.append(PageOp("to_device", p, slot))
        self._hash_to_page[h] = p
        self._page_hash[p] = h
        self._page_tokens[p] = tokens
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
                if self.record_freed:
                    self._ops.append(PageOp("poison", p))

    def _unregister(self, p: int) -> None:
        h = self._page_hash.pop(p)
        del self._hash_to_page[h]
        del self._page_tokens[p]

    def _hashes(self, seq: Sequence, num_pages: int) -> list[int]:
        """``seq.page_hashes`` extended to cover its first ``num_pages`` (full) pages."""
        hs, ps = seq.page_hashes, self.page_size
        while len(hs) < num_pages:
            i = len(hs)
            parent = hs[-1] if hs else root_hash(seq.params.cache_salt, seq.lora_id)
            hs.append(hash((parent, tuple(seq.token_ids_slice(i * ps, (i + 1) * ps)))))
        return hs


def root_hash(cache_salt: str | None, lora_id: int = 0) -> int:
    """The chain's seed: a salt gives its requests a chain of their own, and so does each
    loaded LoRA adapter (its KV differs from the base model's for the same tokens)."""
    if cache_salt is None:
        root = _ROOT_HASH
    else:
        # hash() of a str is randomized per process (PYTHONHASHSEED); a digest is not.
        root = int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=8).digest(), "little")
    return root if not lora_id else hash((root, "lora", lora_id))

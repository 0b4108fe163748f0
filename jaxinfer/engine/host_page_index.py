"""Bookkeeping of the host-memory KV tier: which cached pages the host pool holds (no jax).

The host pool (engine/kv_offload.py, owned by the runner) is ``num_slots`` page-sized
slots in host RAM. This index says which chain hash each slot holds, with its tokens, and
keeps the slots in least-recently-used order. The block manager consults it when a device
page is evicted (copy it to a slot) or a prefix lookup misses on the device (copy a slot
back); the runner moves the bytes.

The tier is inclusive: a slot copied back to the device stays in the pool, so evicting
that device page again costs no copy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HostPage:
    """A prefix-lookup result that lives in host slot ``slot`` (not on the device)."""

    slot: int


class HostPageIndex:
    def __init__(self, num_slots: int) -> None:
        if not (isinstance(num_slots, int) and num_slots >= 0):
            raise ValueError(f"num_slots: must be a non-negative integer, got {num_slots!r}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()      # slot -> None, least recent first
        self._hash_to_slot: dict[int, int] = {}
        self._slot_hash: dict[int, int] = {}
        self._slot_tokens: dict[int, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._slot_hash)

    def __contains__(self, h: int) -> bool:
        return h in self._hash_to_slot

    def find(self, h: int, tokens: tuple[int, ...]) -> int | None:
        """The slot holding chain hash ``h`` with exactly these tokens, or None."""
        slot = self._hash_to_slot.get(h)
        if slot is None or self._slot_tokens[slot] != tokens:
            return None
        return slot

    def entry(self, slot: int) -> tuple[int, tuple[int, ...]]:
        """(chain hash, tokens) of a held slot."""
        return self._slot_hash[slot], self._slot_tokens[slot]

    def touch(self, slot: int) -> None:
        self._lru.move_to_end(slot)

    def put(self, h: int, tokens: tuple[int, ...], pinned: Collection[int] = ()) -> int | None:
        """A slot for a new entry (a free slot, else the least recently used one not in
        ``pinned``), or None when every slot is pinned: the page is then simply dropped."""
        if self._free:
            slot = self._free.pop()
        else:
            slot = next((s for s in self._lru if s not in pinned), None)
            if slot is None:
                return None
            self._drop(slot)
            self._free.pop()
        self._hash_to_slot[h] = slot
        self._slot_hash[slot] = h
        self._slot_tokens[slot] = tokens
        self._lru[slot] = None
        return slot

    def clear(self) -> None:
        for slot in list(self._slot_hash):
            self._drop(slot)

    def check_invariants(self) -> None:
        held, free = set(self._slot_hash), set(self._free)
        assert not (held & free), f"host slots both held and free: {sorted(held & free)}"
        assert held | free == set(range(self.num_slots)), "a host slot is lost"
        assert set(self._lru) == held and len(self._hash_to_slot) == len(held)
        for h, s in self._hash_to_slot.items():
            assert self._slot_hash[s] == h, f"host hash table and slot {s} disagree"

    def _drop(self, slot: int) -> None:
        h = self._slot_hash.pop(slot)
        del self._hash_to_slot[h]
        del self._slot_tokens[slot]
        del self._lru[slot]
        self._free.append(slot)

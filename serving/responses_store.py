"""The Responses API's stored responses: what ``GET /v1/responses/{id}`` returns and what
``previous_response_id`` continues, kept in memory, bounded.

Bounds: at most ``max_entries`` responses and ``max_bytes`` of them in all (their JSON),
the least recently used evicted first; one over ``max_entry_bytes`` is not stored at all
(the route then answers with ``"store": false``, so the client knows); each lives at most
``ttl_s`` from when it was stored. A conversation continued with ``previous_response_id``
is stored whole with every response (its items are what the next turn prepends), so a long
chain costs memory per turn: the byte bound is what holds it. Nothing survives a restart.

The routes run on the event loop but the request parser (which looks up
``previous_response_id``) runs in a worker thread: one lock guards the table.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from jaxinfer.bounds import require
from serving.jsonio import dumps

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 256 << 20
DEFAULT_MAX_ENTRY_BYTES = 16 << 20
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict                   # the response object, as it was answered
    conversation: tuple[dict, ...]   # input items, then the output items: what a next turn prepends
    size: int                        # bytes of both as JSON
    expires: float                   # on the store's clock


class ResponseStore:
    """An LRU table of responses by id, bounded in entries, bytes and age."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_entry_bytes: int | None = None, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        require(max_entries >= 1, "max_entries", f"must be >= 1, got {max_entries}")
        require(max_bytes >= 1, "max_bytes", f"must be >= 1, got {max_bytes}")
        require(ttl_s > 0, "ttl_s", f"must be > 0, got {ttl_s}")
        self.max_entries, self.max_bytes, self.ttl_s, self.clock = max_entries, max_bytes, ttl_s, clock
        self.max_entry_bytes = min(max_bytes, DEFAULT_MAX_ENTRY_BYTES if max_entry_bytes is None
                                   else max_entry_bytes)
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, rid: str, response: dict, conversation: list[dict] | tuple[dict, ...]) -> bool:
        """Store (or replace) ``rid``; False when it is over ``max_entry_bytes`` (not stored)."""
        size = len(dumps(response)) + len(dumps(list(conversation)))
        if size > self.max_entry_bytes:
            return False
        now = self.clock()
        entry = StoredResponse(response, tuple(conversation), size, now + self.ttl_s)
        with self._lock:
            self._drop(rid)
            self._expire(now)
            while self._items and (len(self._items) >= self.max_entries or self._bytes + size > self.max_bytes):
                self._drop(next(iter(self._items)))
            self._items[rid] = entry
            self._bytes += size
        return True

    def get(self, rid: str) -> StoredResponse | None:
        with self._lock:
            entry = self._items.get(rid)
            if entry is None:
                return None
            if entry.expires <= self.clock():
                self._drop(rid)
                return None
            self._items.move_to_end(rid)
            return entry

    def delete(self, rid: str) -> bool:
        with self._lock:
            entry = self._items.get(rid)
            self._drop(rid)
            return entry is not None and entry.expires > self.clock()

    def _drop(self, rid: str) -> None:
        entry = self._items.pop(rid, None)
        if entry is not None:
            self._bytes -= entry.size

    def _expire(self, now: float) -> None:
        # Entries expire in the order they were stored, not in LRU order: a full sweep, at
        # most max_entries, on each put.
        for rid in [r for r, e in self._items.items() if e.expires <= now]:
            self._drop(rid)

"""Moves KV pages between the device cache and the host pool (the runner's side of the
host-memory tier; the block manager decides what moves, engine/block_manager.py PageOp).

The host pool mirrors the cache's pytree (every leaf: K and V of every layer, and int8
pages' scales) with ``num_slots`` page rows instead of ``num_pages``, in host numpy.
Copies run in whole-page batches of a fixed size from ``PAGE_BATCHES`` (padded with page
0, the padding sink), through two executables per size compiled at start-up: a gather
(device pages -> host) and a scatter (host rows -> device pages, the cache donated and
updated in place). Nothing compiles after warm-up, whatever the number of pages moved.

Test poisoning ("poison" ops) reuses the scatter with NaN (floats) / 127 (int8) rows.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import jax
import numpy as np

from jaxinfer.engine.block_manager import PageOp

# Pages per copy call: a small size for the odd page and a large one for a long prefix,
# so a 32-page hit is one call and a one-page eviction does not move 32 pages.
PAGE_BATCHES = (4, 32)


def _gather(kv: Any, pages: jax.Array) -> list[jax.Array]:
    """Every leaf's rows ``pages`` i32[B] -> list of [B, ...] (the host copy's input)."""
    return [x[pages] for x in jax.tree.leaves(kv)]


def _scatter(kv: Any, pages: jax.Array, rows: list[jax.Array]) -> Any:
    """The cache with rows [B, ...] written at ``pages`` i32[B] (duplicates only at page 0)."""
    leaves, treedef = jax.tree.flatten(kv)
    out = [x.at[pages].set(r.astype(x.dtype), mode="promise_in_bounds") for x, r in zip(leaves, rows)]
    return jax.tree.unflatten(treedef, out)


class PageMover:
    """The host pool of one replica and its compiled page copies."""

    def __init__(self, kv: Any, num_slots: int, mesh: Any = None) -> None:
        leaves = jax.tree.leaves(kv)
        self.num_slots = num_slots
        self.mesh = mesh
        self.host = [np.zeros((num_slots, *x.shape[1:]), x.dtype) for x in leaves]
        self._shardings = [getattr(x, "sharding", None) for x in leaves]
        self._gathers: dict[int, Any] = {}
        self._scatters: dict[int, Any] = {}
        self.pages_to_host = 0
        self.pages_to_device = 0
        self.copy_seconds = 0.0

    def compile(self, kv: Any) -> float:
        """AOT-compile the gather and scatter of every batch size; returns seconds."""
        t0 = time.perf_counter()
        absk = jax.tree.map(self._abstract, kv)
        for b in PAGE_BATCHES:
            idx = self._abstract(np.zeros(b, np.int32), replicated=True)
            rows = [self._abstract_rows(x, b, s) for x, s in zip(jax.tree.leaves(kv), self._shardings)]
            self._gathers[b] = jax.jit(_gather).lower(absk, idx).compile()
            self._scatters[b] = jax.jit(_scatter, donate_argnums=0).lower(absk, idx, rows).compile()
        return time.perf_counter() - t0

    def apply(self, kv: Any, ops: list[PageOp], poison: bool) -> Any:
        """Run ``ops`` in order (runs of one kind batched) -> the updated cache."""
        t0 = time.perf_counter()
        for kind, run in itertools.groupby(ops, key=lambda o: o.kind):
            run = list(run)
            if kind == "to_host":
                self._to_host([o.page for o in run], [o.slot for o in run], kv)
                self.pages_to_host += len(run)
            elif kind == "to_device":
                kv = self._to_device(kv, [o.page for o in run], [o.slot for o in run])
                self.pages_to_device += len(run)
            elif kind == "poison":
                if poison:
                    kv = self._to_device(kv, [o.page for o in run], None)
            else:
                raise ValueError(f"unknown page op {kind!r}")
        self.copy_seconds += time.perf_counter() - t0
        return kv

    # ---- internals ----------------------------------------------------------------
    def _batches(self, n: int):
        """(start, stop, batch size) covering n pages with compiled sizes."""
        big = PAGE_BATCHES[-1]
        for start in range(0, n, big):
            k = min(big, n - start)
            yield start, start + k, next(b for b in PAGE_BATCHES if b >= k)

    def _to_host(self, pages: list[int], slots: list[int], kv: Any) -> None:
        for a, z, b in self._batches(len(pages)):
            idx = np.zeros(b, np.int32)
            idx[:z - a] = pages[a:z]
            out = self._gathers[b](kv, self._put(idx, None))
            for host, x in zip(self.host, out):
                host[slots[a:z]] = np.asarray(x)[:z - a]

    def _to_device(self, kv: Any, pages: list[int], slots: list[int] | None) -> Any:
        """Write host rows ``slots`` (None: poison values) into device ``pages``."""
        for a, z, b in self._batches(len(pages)):
            idx = np.zeros(b, np.int32)             # padding rows rewrite the sink page 0
            idx[:z - a] = pages[a:z]
            rows = []
            for host, sh in zip(self.host, self._shardings):
                r = np.zeros((b, *host.shape[1:]), host.dtype)
                if slots is None:
                    r[:z - a] = np.nan if np.issubdtype(host.dtype, np.floating) else 127
                else:
                    r[:z - a] = host[slots[a:z]]
                rows.append(self._put(r, sh))
            kv = self._scatters[b](kv, self._put(idx, None), rows)
        return kv

    def _put(self, x: np.ndarray, sharding: Any) -> Any:
        if self.mesh is None:
            return x
        from jaxinfer import sharding as shd
        return jax.device_put(x, sharding if sharding is not None else shd.replicated(self.mesh))

    def _abstract(self, x: Any, replicated: bool = False) -> jax.ShapeDtypeStruct:
        if self.mesh is None:
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        from jaxinfer import sharding as shd
        return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                    sharding=shd.replicated(self.mesh) if replicated else x.sharding)

    def _abstract_rows(self, x: Any, b: int, sharding: Any) -> jax.ShapeDtypeStruct:
        shape = (b, *x.shape[1:])
        if self.mesh is None:
            return jax.ShapeDtypeStruct(shape, x.dtype)
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)

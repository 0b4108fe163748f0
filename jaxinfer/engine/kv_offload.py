"""Moves KV pages between the device cache and the host pool (the runner's side of the
host-memory tier; the block manager decides what moves, engine/block_manager.py PageOp).

The host pool mirrors the cache's pytree (every leaf: K and V of every layer, and int8
pages' scales) with ``num_slots`` page rows instead of ``num_pages``, in host numpy (a
stacked pool, kv_cache.StackedKV, has its pages on axis 1: a host row is then [L, ...]).
Copies run in whole-page batches of a fixed size from ``PAGE_BATCHES`` (padded with page
0, the padding sink), through two executables per size compiled at start-up: a gather
(device pages -> host) and a scatter (host rows -> device pages, the cache donated and
updated in place). Nothing compiles after warm-up, whatever the number of pages moved.

Test poisoning ("poison" ops) reuses the scatter with NaN (floats) / 127 (int8) rows.

Device-to-device copies ("copy" ops: beam search forks a beam's partially filled last
page, engine/beam.py) run through one more executable, ``COPY_BATCH`` pages per call.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine import kv_cache as kvc
from jaxinfer.engine.block_manager import PageOp

# Pages per copy call: a small size for the odd page and a large one for a long prefix,
# so a 32-page hit is one call and a one-page eviction does not move 32 pages.
PAGE_BATCHES = (4, 32)
COPY_BATCH = 8       # a fork copies one page per new beam: a few per step


def _pages(kv: Any, idx: jax.Array) -> Any:
    """The index of pages ``idx`` in every leaf of ``kv`` (axis 0, or 1 in a stacked pool)."""
    return (slice(None), idx) if kvc.page_axis(kv) else idx


def _copy(kv: Any, src: jax.Array, dst: jax.Array) -> Any:
    """The cache with page ``dst[i]`` := page ``src[i]`` (i32[B]; padding copies 0 -> 0)."""
    s, d = _pages(kv, src), _pages(kv, dst)
    return jax.tree.map(lambda x: x.at[d].set(x[s], mode="promise_in_bounds"), kv)


def _gather(kv: Any, pages: jax.Array) -> list[jax.Array]:
    """Every leaf's rows ``pages`` i32[B] -> list of [B, ...] (the host copy's input; a
    stacked pool's [B, L, ...])."""
    axis, p = kvc.page_axis(kv), _pages(kv, pages)
    return [jnp.moveaxis(x[p], axis, 0) for x in jax.tree.leaves(kv)]


def _scatter(kv: Any, pages: jax.Array, rows: list[jax.Array]) -> Any:
    """The cache with rows [B, ...] (a stacked pool's [B, L, ...]) written at ``pages``
    i32[B] (duplicates only at page 0)."""
    leaves, treedef = jax.tree.flatten(kv)
    axis, p = kvc.page_axis(kv), _pages(kv, pages)
    out = [x.at[p].set(jnp.moveaxis(r, 0, axis).astype(x.dtype), mode="promise_in_bounds")
           for x, r in zip(leaves, rows)]
    return jax.tree.unflatten(treedef, out)


def _rows_shape(x: Any, axis: int) -> tuple[int, ...]:
    """One page's row of leaf x: its shape without the page axis (layers first if stacked)."""
    return tuple(d for i, d in enumerate(x.shape) if i != axis)


class PageMover:
    """The host pool of one replica and its compiled page copies."""

    def __init__(self, kv: Any, num_slots: int, mesh: Any = None) -> None:
        leaves = jax.tree.leaves(kv)
        self.num_slots = num_slots
        self.mesh = mesh
        self._axis = kvc.page_axis(kv)
        self.host = [np.zeros((num_slots, *_rows_shape(x, self._axis)), x.dtype) for x in leaves]
        self._shardings = [getattr(x, "sharding", None) for x in leaves]
        self._gathers: dict[int, Any] = {}
        self._scatters: dict[int, Any] = {}
        self._copy: Any = None
        self.pages_to_host = 0
        self.pages_to_device = 0
        self.pages_copied = 0
        self.copy_seconds = 0.0

    def compile(self, kv: Any, host: bool = True) -> float:
        """AOT-compile the device page copy, and (``host``: a host pool or poisoning) the
        gather and scatter of every batch size; returns seconds."""
        t0 = time.perf_counter()
        absk = jax.tree.map(self._abstract, kv)
        idx = self._abstract(np.zeros(COPY_BATCH, np.int32), replicated=True)
        self._copy = jax.jit(_copy, donate_argnums=0).lower(absk, idx, idx).compile()
        for b in PAGE_BATCHES if host else ():
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
            elif kind == "copy":
                kv = self._copy_pages(kv, [o.slot for o in run], [o.page for o in run])
                self.pages_copied += len(run)
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

    def _copy_pages(self, kv: Any, src: list[int], dst: list[int]) -> Any:
        for a in range(0, len(src), COPY_BATCH):
            s, d = np.zeros(COPY_BATCH, np.int32), np.zeros(COPY_BATCH, np.int32)
            s[:len(src[a:a + COPY_BATCH])] = src[a:a + COPY_BATCH]
            d[:len(dst[a:a + COPY_BATCH])] = dst[a:a + COPY_BATCH]
            kv = self._copy(kv, self._put(s, None), self._put(d, None))
        return kv

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
        shape = (b, *_rows_shape(x, self._axis))
        if self.mesh is None:
            return jax.ShapeDtypeStruct(shape, x.dtype)
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)

"""Multi-LoRA, the device side: the adapters' slot arrays and the one hook into the
model's matmul.

Layout. For every target weight W [K, N] (engine/lora.py ``lora_targets``) the device
holds A_all [K, S*R] and B_all [S*R, N]: slot s (1..S) owns columns / rows
[(s-1)*R, s*R) (rank padded to R = --max-lora-rank with zeros, which add nothing). They
are runtime arguments of every step executable, so loading an adapter is a copy into its
slot by one executable compiled at start-up: no step ever recompiles for an adapter.

The delta of a step's rows (each token row t carries its slot index, 0 = none):

    h = x @ A_all                        [T, S*R]   one matmul over every slot
    h = where(column's slot == slot[t], h, 0)       keep the row's own slot
    y = x @ W + h @ B_all                [T, N]

Both products go through the model's own ``mm`` (the batch-invariant kernels), so a row's
delta is computed from its own activations and its own slot's columns in a fixed order:
another row's adapter only adds exact zeros (0 * b = 0; acc + 0 = acc), so a request's
bits do not depend on its neighbours or on which slot its adapter sits in (CPU f32
kernel; on XLA dots, see README). A row with slot 0 adds an exact zero: the base model's
bits. A step in which no row has an adapter skips the delta (lax.cond).

Why not a gather of each row's A/B ([T, K, R] / [T, R, N], Punica's BGMV in jnp) or
``lax.ragged_dot`` over rows sorted by slot: on XLA:CPU both were several times slower than
these two dense products (gathered rows stream each row's own copy of B; ragged_dot lowers
to masked dense products per group; RESULTS.md, "Design measurements") and ragged_dot's
rows were not batch-invariant. The dense products cost S*R columns per target, so the slot count
and rank are the knobs (README, benchmarks/lora.py).

Tensor parallelism: A and B are sharded like their weight: column-parallel targets
(q/k/v/gate/up) split B's output axis (A replicated); row-parallel ones (o/down) split A's
input axis (B replicated) and the partial deltas ride the weight's own all-reduce.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import sharding as shd
from jaxinfer.engine.lora import LoraAdapter, LoraRegistry, LoraTarget, SlotTable, lora_targets


@dataclasses.dataclass(frozen=True)
class LoraWeight:
    """A target weight inside the step: the model's weight plus its slot arrays and the
    step's row mask. ``parts``: (A_all, B_all) per part of a fused weight (wqkv: q, k, v),
    whose deltas are concatenated like the fused product."""

    base: Any
    parts: tuple[tuple[jax.Array, jax.Array], ...]
    mask: jax.Array            # bool[T, S*R]: the columns of each row's slot
    active: jax.Array          # bool[]: some row has an adapter

    def __getitem__(self, key: Any) -> "LoraWeight":
        """``param[...]`` (how a model reads its weights) returns the weight itself."""
        if key is Ellipsis:
            return self
        raise TypeError("LoraWeight supports only [...] indexing")


def with_lora(mm: Callable) -> Callable:
    """The model's ``mm`` hook extended to LoraWeight (other weights go straight to ``mm``)."""

    def lora_mm(x: jax.Array, w: Any) -> jax.Array:
        if not isinstance(w, LoraWeight):
            return mm(x, w)
        y = mm(x, w.base)                                                # [T, N]

        def delta() -> jax.Array:
            ds = [mm(jnp.where(w.mask, mm(x, a), 0), b) for a, b in w.parts]   # [T, N_part]
            return y + (ds[0] if len(ds) == 1 else jnp.concatenate(ds, axis=-1)).astype(y.dtype)

        return jax.lax.cond(w.active, delta, lambda: y)

    return lora_mm


def slot_mask(slots: jax.Array, num_slots: int, rank: int) -> jax.Array:
    """slots i32[T] (0 = none) -> bool[T, num_slots * rank]: True on the row's slot's columns."""
    col_slot = jnp.arange(num_slots * rank, dtype=jnp.int32) // rank + 1
    return col_slot[None, :] == slots[:, None]


def bind(model: Any, arrays: dict[str, tuple[jax.Array, jax.Array]], slots: jax.Array,
         num_slots: int, rank: int) -> None:
    """In place (a module merged inside the step's trace): every target weight of ``model``
    becomes a LoraWeight over ``arrays`` (our path -> (A_all, B_all), this device's shards)
    for the step's token slots i32[T]. Fused weights (quantization.FUSED) take their parts'."""
    from jaxinfer.quantization import FUSED

    if not arrays:
        return
    mask = slot_mask(slots, num_slots, rank)
    active = (slots > 0).any()
    names = [(n, (n,)) for n in dict.fromkeys(p.rsplit(".", 1)[-1] for p in arrays)] + list(FUSED)
    for i, layer in enumerate(model.layers):
        for name, parts in names:
            paths = [f"layers.{i}.{p}" for p in parts]
            if hasattr(layer, name) and all(p in arrays for p in paths):
                param = getattr(layer, name)
                param.set_value(LoraWeight(param.get_value(), tuple(arrays[p] for p in paths), mask, active))


class LoraSlots:
    """The slot arrays of one engine replica (on its mesh, or the default device) and the
    executable that writes one adapter into one slot (compiled here, at start-up)."""

    def __init__(self, cfg: Any, run_cfg: Any, num_slots: int, rank: int, dtype: Any, mesh: Any = None):
        self.cfg, self.num_slots, self.rank, self.mesh = cfg, num_slots, rank, mesh
        self.dtype = jnp.dtype(dtype)
        self.tp = shd.tp_size(mesh)
        self.table = SlotTable(num_slots)
        self.targets: dict[str, LoraTarget] = {t.path: t for t in lora_targets(run_cfg).values()}
        width = num_slots * rank
        shapes = {p: ((t.shape[0], width), (width, t.shape[1])) for p, t in self.targets.items()}
        self.shardings = {p: (self._sharding((t.axes[0], None)), self._sharding((None, t.axes[1])))
                          for p, t in self.targets.items()}
        # one executable makes every zero array (one per array took minutes at start-up)
        self.arrays = jax.jit(lambda: {p: tuple(jnp.zeros(x, self.dtype) for x in shapes[p]) for p in shapes},
                              out_shardings=None if mesh is None else self.shardings)()
        slot_shapes = {p: ((t.shape[0], rank), (rank, t.shape[1])) for p, t in self.targets.items()}
        abstract = lambda shapes_, shards: jax.tree.map(   # noqa: E731
            lambda s, sh: jax.ShapeDtypeStruct(s, self.dtype, sharding=sh), shapes_, shards,
            is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(v, int) for v in x))
        self._write = jax.jit(functools.partial(_write_slot, rank=rank), donate_argnums=0).lower(
            abstract(shapes, self.shardings), jax.ShapeDtypeStruct((), jnp.int32),
            abstract(slot_shapes, self.shardings)).compile()

    def _sharding(self, axes: tuple[Any, Any]) -> Any:
        if self.mesh is None:
            return None
        return jax.sharding.NamedSharding(self.mesh, shd.partition_spec(axes))

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for ab in self.arrays.values() for a in ab)

    def assign(self, lora_ids: set[int], registry: LoraRegistry) -> dict[int, int]:
        """Slots for a step's adapters (lora_id -> slot; 0 -> 0), copying in those not
        resident (least recently used out)."""
        slot_of, loads = self.table.assign(lora_ids)
        for slot, lora_id in loads:
            self.write(slot, registry.by_id(lora_id))
        return slot_of

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy ``adapter`` into ``slot`` (1..num_slots): its targets rank-padded, the rest zeros."""
        if not 1 <= slot <= self.num_slots:
            raise ValueError(f"slot: must be in [1, {self.num_slots}], got {slot}")
        host = {}
        for p, t in self.targets.items():
            a = np.zeros((t.shape[0], self.rank), np.float32)
            b = np.zeros((self.rank, t.shape[1]), np.float32)
            if p in adapter.data.weights:
                a0, b0 = adapter.data.weights[p]
                b0 = self._repeat_kv_heads(p, b0)
                a[:, :a0.shape[1]], b[:b0.shape[0]] = a0, b0
            host[p] = (a.astype(self.dtype), b.astype(self.dtype))
        dev = {p: tuple(x if sh is None else shd.put(x, sh) for x, sh in zip(host[p], self.shardings[p]))
               for p in host}
        self.arrays = self._write(self.arrays, np.int32(slot), dev)

    def _repeat_kv_heads(self, path: str, b: np.ndarray) -> np.ndarray:
        """B of wk / wv with each KV head's columns repeated as the sharded model's weights are
        (sharding.replicate_kv_heads) when tensor parallelism outnumbers the KV heads."""
        if self.tp == 1 or path.rsplit(".", 1)[-1] not in ("wk", "wv"):
            return b
        return shd.replicate_kv_heads(self.cfg, {path: b}, self.tp)[path]

    def specs(self) -> dict[str, tuple[Any, Any]]:
        """PartitionSpecs of the arrays (shard_map's in_specs)."""
        return {p: tuple(shd.P() if sh is None else sh.spec for sh in self.shardings[p]) for p in self.targets}


def _write_slot(arrays: dict, slot: jax.Array, new: dict, *, rank: int) -> dict:
    col = (slot - 1) * rank
    return {p: (jax.lax.dynamic_update_slice(a, new[p][0], (0, col)),
                jax.lax.dynamic_update_slice(b, new[p][1], (col, 0))) for p, (a, b) in arrays.items()}

"""Weight offload: layers whose weights do not fit a device budget stay in host memory and
are streamed to the device one layer ahead of use (``--offload-weights host``,
``--device-weight-memory BYTES``).

Placement (``plan``, then ``place`` on the runner's state): the embedding, final norm and LM head stay on the device,
then layers 0, 1, ... while the resident total fits the budget; every later layer's
weights live in the backend's host memory kind (``pinned_host`` where it has one, so the
copies are DMA from page-locked memory; XLA:CPU exposes ``device``, ``pinned_host`` and
``unpinned_host``, all host RAM, and runs the same code path).

Streaming (``bind``, inside the step's trace): each offloaded weight of the model is read
through an ``OffloadedWeight``. When layer i reaches its attention (the attention callback
sees every layer), the copies of layer i+1's offloaded weights to device memory are
issued, tied to layer i's queries by an optimization barrier: they start once layer i is
under way and overlap its attention and MLP, and layer i+1 reads the copies. At most two
offloaded layers' weights are on the device at once (they are step temporaries, freed
after use), on top of the resident ones. The arithmetic is unchanged, so the tokens are the
same bits with offload on and off.

Single device per replica for now: tensor / pipeline parallelism and LoRA are refused.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax import lax


def host_memory_kind(device: Any) -> str:
    """The host memory kind weights are offloaded to on ``device``'s backend."""
    kinds = [m.kind for m in device.addressable_memories()]
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            return kind
    raise ValueError(f"offload_weights: the {device.platform} backend has no host memory kind "
                     f"(it offers {', '.join(kinds)})")


def layer_bytes(model: Any) -> tuple[int, list[int]]:
    """(bytes of the weights outside the layers, bytes of each layer's weights)."""
    from flax import nnx

    per = [0] * len(model.layers)
    other = 0
    for path, var in nnx.to_flat_state(nnx.state(model)):
        n = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(var.get_value()))
        if path[0] == "layers":
            per[path[1]] += n
        else:
            other += n
    return other, per


def plan(other: int, per_layer: list[int], budget: int) -> tuple[int, ...]:
    """The layers to offload: all from the first whose weights no longer fit ``budget``
    bytes beside the non-layer weights and the layers before it."""
    if budget < other:
        raise ValueError(f"device_weight_memory: {budget} bytes is less than the embedding, final norm "
                         f"and LM head need on the device ({other} bytes)")
    used, first = other, len(per_layer)
    for i, n in enumerate(per_layer):
        if used + n > budget:
            first = i
            break
        used += n
    return tuple(range(first, len(per_layer)))


def place(state: Any, layers: tuple[int, ...]) -> Any:
    """A copy of the model's nnx State (the given one and its Variables untouched: other
    engines may share them) with the weights of ``layers`` moved to the host memory kind."""
    from flax import nnx

    flat = []
    for path, var in nnx.to_flat_state(state):
        if path[0] == "layers" and path[1] in layers:
            value = var.get_value()
            kind = host_memory_kind(next(iter(jax.tree.leaves(value)[0].sharding.device_set)))
            var = var.replace(value=jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(kind)), value))
        flat.append((path, var))
    return nnx.from_flat_state(flat)


def resident_bytes(leaves: list[Any]) -> tuple[int, int]:
    """(bytes in device memory, bytes in host memory) of a model's weight arrays."""
    dev = host = 0
    for x in leaves:
        n = x.size * x.dtype.itemsize
        if x.sharding.memory_kind in (None, "device"):
            dev += n
        else:
            host += n
    return dev, host


class OffloadedWeight:
    """One offloaded weight inside the step's trace: its host value and, once issued, its
    copy in device memory. ``param[...]`` (how a model reads its weights) returns the copy."""

    def __init__(self, host: Any):
        self.host = host
        self.device: Any = None

    def fetch(self, after: jax.Array | None = None) -> None:
        """Issue the copy to device memory (once), not before ``after`` is computed."""
        if self.device is None:
            host = self.host if after is None else lax.optimization_barrier((after, self.host))[1]
            self.device = jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), host)

    def __getitem__(self, key: Any) -> Any:
        if key is not Ellipsis:
            raise TypeError("OffloadedWeight supports only [...] indexing")
        self.fetch()
        return self.device


def bind(model: Any, attn: Callable, layers: tuple[int, ...]) -> Callable:
    """In place (a module merged inside the step's trace): the weights of ``layers`` become
    OffloadedWeights; returns the attention callback that, at layer i, issues layer i+1's
    copies."""
    held: dict[int, list[OffloadedWeight]] = {}
    for i in layers:
        for _, var in _layer_params(model.layers[i]):
            w = OffloadedWeight(var.get_value())
            var.set_value(w)
            held.setdefault(i, []).append(w)

    def prefetching_attn(layer: int, q, k, v, cache):
        for w in held.get(layer + 1, ()):
            w.fetch(after=q)
        return attn(layer, q, k, v, cache)

    return prefetching_attn if held else attn


def _layer_params(layer: Any) -> list[tuple[str, Any]]:
    from flax import nnx

    return [(name, var) for name, var in vars(layer).items() if isinstance(var, nnx.Param)]

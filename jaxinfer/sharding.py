"""The device mesh and the one table from logical weight axes to mesh axes.

Mesh axes: ("data", "stage", "model"). "data" indexes independent engine replicas (each its
own scheduler and KV cache, see engine/engine.py); "stage" splits a replica's layers into
pipeline stages (engine/pipeline.py: every weight and KV page of a layer lives on the
stage that owns it, stacked along a leading axis split over "stage"); "model" is Megatron
tensor parallelism inside one stage. No other module names a mesh axis: they ask this one.

Tensor parallelism of the Llama family (models/llama.py runs the per-device body under
``jax.shard_map``):
* column-parallel wq / wk / wv / w_gate / w_up (their output axis is split),
* row-parallel wo / w_down (their input axis is split; a psum over "model" follows each:
  exactly two all-reduces per layer),
* vocabulary-parallel embedding (each device looks up the ids in its slice, a psum
  assembles the rows) and LM head (each device computes its slice of the logits, one
  all-gather assembles them for the sampler),
* KV pages split by KV head. When the model axis is larger than the number of KV heads
  (SmolLM2: 3 KV heads), each KV head is repeated ``tp // num_kv_heads`` times at load
  time, so every device holds exactly the KV head its query heads read.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA = "data"
STAGE = "stage"
MODEL = "model"

# Logical axis (models/llama.py WeightSpec.axes) -> mesh axis. None: replicated.
LOGICAL_AXES: dict[str, str | None] = {
    "vocab": MODEL,
    "q_heads": MODEL,
    "kv_heads": MODEL,
    "mlp": MODEL,
    "expert": MODEL,      # expert parallelism: each device holds num_experts / tp experts
    "embed": None,
}

def kv_pages_spec(ndim: int) -> P:
    """The paged KV cache [num_pages, page_size, kv_heads, head_dim] is split by KV head
    (and so are int8 pages' scales [num_pages, page_size, kv_heads])."""
    return P(None, None, MODEL, *([None] * (ndim - 3)))


def make_mesh(tensor_parallel_size: int, data_parallel_size: int = 1,
              devices: Sequence[Any] | None = None, pipeline_parallel_size: int = 1) -> Mesh:
    """A ("data", "stage", "model") mesh over the first dp * pp * tp devices (all processes'
    devices under jax.distributed, process-major, so a model axis spans hosts only when it
    must, and stages before it)."""
    devices = list(jax.devices() if devices is None else devices)
    tp, dp, pp = tensor_parallel_size, data_parallel_size, pipeline_parallel_size
    need = tp * dp * pp
    if need > len(devices):
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size x data_parallel_size = "
                         f"{tp} x {pp} x {dp} = {need} devices, but only {len(devices)} "
                         f"are visible ({devices[0].platform})")
    grid = np.array(devices[:need], dtype=object).reshape(dp, pp, tp)
    return Mesh(grid, (DATA, STAGE, MODEL))


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One ("data"=1, "stage"=pp, "model"=tp) mesh per data-parallel replica."""
    return [Mesh(mesh.devices[i:i + 1], (DATA, STAGE, MODEL)) for i in range(mesh.devices.shape[0])]


def kv_head_replication(num_heads: int, num_kv_heads: int, tp: int) -> int:
    """How many times each KV head is repeated so that ``tp`` devices split them evenly:
    1 when tp divides num_kv_heads; tp // num_kv_heads when num_kv_heads divides tp."""
    if num_kv_heads % tp == 0:
        return 1
    if tp % num_kv_heads == 0 and num_heads % tp == 0:
        return tp // num_kv_heads
    raise ValueError(f"tensor_parallel_size={tp}: the model's {num_kv_heads} KV heads can be "
                     f"neither split over {tp} devices nor replicated onto them (one must "
                     f"divide the other)")


def check_tensor_parallel(cfg: Any, tp: int) -> None:
    """Raise a ValueError naming the constraint a model breaks for this tp (cfg: ModelConfig)."""
    if tp == 1:
        return
    for what, n in _split_counts(cfg):
        if n % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the model's {n} {what}; "
                             f"sizes that work: {', '.join(map(str, valid_tp_sizes(cfg)))}")
    kv_head_replication(cfg.num_heads, cfg.num_kv_heads, tp)


def _split_counts(cfg: Any) -> list[tuple[str, int]]:
    """What tensor parallelism splits over the model axis: (name, count) pairs."""
    out = [("query heads (num_attention_heads)", cfg.num_heads),
           ("MLP width (intermediate_size)", cfg.intermediate_size),
           ("vocabulary (vocab_size)", cfg.vocab_size)]
    moe = getattr(cfg, "moe", None)
    if moe is not None:
        out.append(("experts (num_experts)", moe.num_experts))
        if moe.shared_expert_size:
            out.append(("shared expert width (shared_expert_intermediate_size)", moe.shared_expert_size))
    return out


def valid_tp_sizes(cfg: Any, limit: int = 64) -> list[int]:
    out = []
    for tp in range(1, limit + 1):
        if any(n % tp for _, n in _split_counts(cfg)):
            continue
        try:
            kv_head_replication(cfg.num_heads, cfg.num_kv_heads, tp)
        except ValueError:
            continue
        out.append(tp)
    return out


def auto_tp_size(cfg: Any, num_devices: int) -> int:
    """The largest tensor-parallel size the model allows on ``num_devices`` devices."""
    return max(t for t in valid_tp_sizes(cfg, max(num_devices, 1)))


def sharded_config(cfg: Any, tp: int) -> Any:
    """The ModelConfig the sharded engine runs: KV heads repeated where tp needs it. Its
    outputs equal the original model's (query head h still reads a copy of KV head
    h // (num_heads // num_kv_heads))."""
    r = kv_head_replication(cfg.num_heads, cfg.num_kv_heads, tp)
    return cfg if r == 1 else dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * r)


def replicate_kv_heads(cfg: Any, flat: dict[str, Any], tp: int) -> dict[str, Any]:
    """Repeat each KV head's columns of wk / wv (and bk / bv) as ``sharded_config`` needs.
    ``flat``: our paths -> host arrays ([D, kv_heads * head_dim] / [kv_heads * head_dim])."""
    r = kv_head_replication(cfg.num_heads, cfg.num_kv_heads, tp)
    if r == 1:
        return flat
    out = dict(flat)
    hd = cfg.head_dim
    for path, arr in flat.items():
        if path.rsplit(".", 1)[-1] in ("wk", "wv", "bk", "bv"):
            a = host_value(arr)
            lead = a.shape[:-1]
            heads = a.reshape(*lead, cfg.num_kv_heads, hd)                   # [..., KVH, hd]
            out[path] = np.repeat(heads, r, axis=-2).reshape(*lead, cfg.num_kv_heads * r * hd)
    return out


def partition_spec(axes: Sequence[str | None]) -> P:
    """Logical axes of a weight -> its PartitionSpec (through LOGICAL_AXES)."""
    return P(*(LOGICAL_AXES[a] if a is not None else None for a in axes))


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """A host array onto the mesh: each device (of this process) receives only its slice,
    so a sharded weight is never whole on one device. Works the same under
    jax.distributed (every process passes the same host value). A jax.Array already
    placed that way is returned as it is."""
    if isinstance(x, jax.Array):
        return x if x.sharding == sharding else jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def placer(mesh: Mesh | None) -> Callable[[Sequence[str | None], Any], jax.Array] | None:
    """(logical axes, host array) -> array placed on ``mesh``; None for the default device."""
    if mesh is None:
        return None
    return lambda axes, x: put(x, NamedSharding(mesh, partition_spec(axes)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[MODEL]


def pp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape.get(STAGE, 1)


def stage_sharding(mesh: Mesh, spec: P) -> NamedSharding:
    """A per-stage array: ``spec`` (the array's own, e.g. split over "model") behind a
    leading axis split over "stage"."""
    return NamedSharding(mesh, P(STAGE, *spec))


def host_value(x: Any) -> np.ndarray:
    """A host array, or a replicated jax.Array's value as numpy (also when other processes
    hold copies: reads this process's own one)."""
    if isinstance(x, jax.Array):
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)

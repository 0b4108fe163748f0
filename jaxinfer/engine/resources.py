"""What an engine is placed on and how much it may hold: meshes for tensor and data
parallelism, the model's copy per replica, the KV pool's and host tier's sizes, and the
caches a start reuses (XLA's persistent compilation cache, the C++ kernels' builds).

Read once at start-up (``Engine.__init__``, engine/build.py); nothing here runs per step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable

from jaxinfer.engine_config import EngineConfig, kv_cache_dtype
from jaxinfer.models.config import ModelConfig
from jaxinfer.host_memory import available_ram, total_ram

log = logging.getLogger("jaxinfer")


# XLA:CPU's LLVM backend at -O1 instead of its default -O2: step executables compile ~5-10%
# faster with the same step times and the same bits (benchmarks/RESULTS.md, "CI time and
# compile options"; without fast-math neither level may reassociate a float sum).
# Code generation in one module instead of 32 parts: each loaded step executable holds
# ~10% less memory (the default model's 27 step shapes: 67 -> 60 MiB; measured, not traced
# to which structure), compile time not worse on 2 cores (RESULTS.md "int8 KV pages by
# default").
CPU_COMPILE_OPTIONS = {"xla_backend_optimization_level": 1, "xla_cpu_parallel_codegen_split_count": 1}


def compiler_options(model: Any = None) -> dict | None:
    """Options every step executable is compiled with on the default backend (forward,
    multi-step decode, sampler, the reference generator's): XLA's defaults (None) off CPU;
    on CPU ``CPU_COMPILE_OPTIONS`` plus what ``model``'s quantized path needs
    (``quantization.cpu_compiler_options``)."""
    import jax

    if jax.default_backend() != "cpu":
        return None
    from jaxinfer.quantization import cpu_compiler_options

    extra = cpu_compiler_options(model) if model is not None else None
    return {**CPU_COMPILE_OPTIONS, **(extra or {})}


def kv_cache_spec(config: EngineConfig, mc: ModelConfig, num_kv_heads: int, model_dtype: Any,
                  max_model_len: int, also: Callable[[Any], Any] | None = None) -> Any:
    """The KV pool's layout: pages in the model's dtype (or int8 values with per-token
    scales), as many as ``config.num_pages`` or the KV budget allows. ``num_kv_heads``: the
    running model's (tensor parallelism may repeat KV heads). ``also``: the layout of a
    second pool with the same page count (a draft model's own, engine/spec_draft.py) from
    this one, or None for none; the budget pays for a page in both."""
    from jaxinfer.engine import kv_cache as kvc

    dtype = "int8" if kv_cache_dtype(config) == "int8" else model_dtype
    probe = kvc.KVCacheSpec(mc.num_layers, 2, config.page_size, num_kv_heads, mc.head_dim, dtype)
    other = also(probe) if also else None
    page_bytes = probe.bytes_per_page + (other.bytes_per_page if other else 0)
    need = config.max_num_seqs * -(-max_model_len // config.page_size) + 1   # + the padding page
    num_pages = config.num_pages or max(2, kv_budget(config, need * page_bytes) // page_bytes)
    return kvc.KVCacheSpec(mc.num_layers, num_pages, config.page_size, num_kv_heads, mc.head_dim, dtype)


def num_processes() -> int:
    import jax

    return jax.process_count()


def process_index() -> int:
    import jax

    return jax.process_index()


def replica_meshes(config: EngineConfig) -> list[Any]:
    """One mesh per data-parallel replica; [] for the plain single-device engine."""
    tp, dp, pp = config.tensor_parallel_size, config.data_parallel_size, config.pipeline_parallel_size
    if tp == 1 and dp == 1 and pp == 1 and num_processes() == 1:
        return []
    from jaxinfer import sharding

    if num_processes() > 1:
        import jax

        if dp > 1:
            raise ValueError("data_parallel_size > 1 with several processes is not supported: run "
                             "one engine per host instead, or use the hosts for tensor parallelism")
        if tp * pp != jax.device_count():
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {tp} x {pp}: with "
                             f"{num_processes()} processes the model must span all {jax.device_count()} "
                             "devices (every process runs the step)")
    return sharding.replica_meshes(sharding.make_mesh(tp, dp, pipeline_parallel_size=pp))


def resolve_auto_tp(config: EngineConfig, model_config: Any, model: str | None) -> EngineConfig:
    """tensor_parallel_size=0: the largest size the model allows on the visible devices
    (all processes' under jax.distributed) divided among the data-parallel replicas."""
    import jax

    from jaxinfer import sharding
    from jaxinfer.loading import read_config

    cfg = model_config or read_config(model)
    tp = sharding.auto_tp_size(cfg, jax.device_count() // (config.data_parallel_size * config.pipeline_parallel_size))
    log.info("tensor_parallel_size auto: %d (%d devices)", tp, jax.device_count())
    return dataclasses.replace(config, tensor_parallel_size=tp)


def engine_models(config: EngineConfig, model: str | None, loaded: Any, meshes: list[Any]
                  ) -> tuple[Any, list[Any]]:
    """(the LoadedModel the engine keeps, each replica's model), the models as the engine
    runs them (quantized, or laid out for the CPU kernels). A single-device model the
    engine loads itself comes through the weight cache and is prepared in place
    (loading/prepared.py); a caller's ``loaded`` is left as it was."""
    from jaxinfer.loading import load_model
    from jaxinfer.quantization import prepare_for_engine, quantize_model

    if loaded is None and not meshes:
        from jaxinfer.loading.prepared import load_prepared

        loaded = load_prepared(model, config.dtype, config.quantization, config.weight_cache_dir,
                               codes=config.weight_codes)
        return loaded, [loaded.model]
    if loaded is None:
        loaded = load_model(model, config.dtype, meshes[0] if meshes else None)
    if meshes:
        models = [quantize_model(m, config.quantization) for m in place_replicas(loaded, meshes)]
    else:
        models = [prepare_for_engine(loaded.model, config.quantization, codes=config.weight_codes)]
    return dataclasses.replace(loaded, model=models[0]), models


def place_replicas(loaded: Any, meshes: list[Any]) -> list[Any]:
    """The model for each replica: the loaded one (placed on the first mesh, re-placed from
    its host values if it was loaded elsewhere), copied shard by shard onto the others."""
    if not meshes:
        return [loaded.model]
    import jax
    from flax import nnx

    from jaxinfer.loading import build_model
    from jaxinfer.models.llama import flat_params

    first = loaded.model
    leaf = jax.tree.leaves(nnx.state(first))[0]
    if getattr(leaf.sharding, "mesh", None) != meshes[0]:
        from jaxinfer.sharding import host_value
        flat = {k: host_value(v) for k, v in flat_params(first).items()}
        first = build_model(loaded.config, flat, first.dtype, meshes[0])
    models = [first]
    graphdef, state = nnx.split(first)
    for mesh in meshes[1:]:
        moved = jax.tree.map(lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, x.sharding.spec)),
                             state)
        models.append(nnx.merge(graphdef, moved))
    return models


def host_kv_pages(config: EngineConfig, bytes_per_page: int, num_replicas: int) -> int:
    """Host-tier pages per replica: ``host_kv_cache_memory`` split among the replicas; by
    default none on CPU (the device's memory is host memory already) and a fraction of RAM
    on accelerators. Only with prefix caching, and one process (followers would not
    replay the copies)."""
    mem = config.host_kv_cache_memory
    if not config.enable_prefix_caching or mem == 0:
        return 0
    if num_processes() > 1:
        if mem is not None:
            raise ValueError("host_kv_cache_memory: the host KV tier runs in one process; "
                             "set it to 0 with jax.distributed")
        return 0
    if mem is None:
        import jax

        if jax.default_backend() == "cpu":
            return 0
        mem = int(total_ram() * config.HOST_KV_CACHE_RAM_FRACTION)
    return mem // num_replicas // bytes_per_page


def kv_budget(config: EngineConfig, need: int | None = None) -> int:
    """Bytes for the KV pages: the configured size, or a fraction of the device's free
    memory where the backend reports it (weights are already resident), else (CPU) what
    the configuration can use (``need``: every sequence at max_model_len), capped: an
    untouched pool (engine/kv_cache.lazily_resident), which costs RAM only for the pages
    requests use, by half the machine's RAM; a zero-filled one, resident from the start,
    by DEFAULT_KV_CACHE_MEMORY and half the RAM available now."""
    if config.kv_cache_memory:
        return config.kv_cache_memory
    import jax

    from jaxinfer.engine.kv_cache import lazily_resident

    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        budget = int(free * config.kv_cache_memory_fraction)
        log.info("KV cache: %.2f GiB (%.0f%% of free device memory)", budget / 2**30,
                 100 * config.kv_cache_memory_fraction)
        return budget
    if lazily_resident():
        # The machine's RAM, not what is free now: the pool's size fixes every compiled
        # step's shapes, so a size that moved with free memory would miss the compilation
        # cache at every start.
        cap = total_ram() // 2
    else:
        ram = available_ram()
        cap = min(EngineConfig.DEFAULT_KV_CACHE_MEMORY, ram // 2 if ram else EngineConfig.DEFAULT_KV_CACHE_MEMORY)
    budget = min(need, cap) if need else cap
    log.info("KV cache: %.0f MiB%s (%s)", budget / 2**20, ", resident as pages are used" if lazily_resident() else "",
             "all sequences at max_model_len" if need and need <= cap else "capped; --kv-cache-memory sets it")
    return budget


def start_background_work(quantization: str | None = None) -> None:
    """Work a start needs later, begun now on the idle core while the sampler compiles: the
    C++ kernels (on CPU, pallas_kernels/cpu_build.py; the matmul kernel that the load of
    ``quantization``'s weights waits for first) and transformers' import (the tokenizer's;
    ~1 s of every start, cold or warm)."""
    import jax

    from jaxinfer.loading.tokenizer import import_transformers_in_background

    if jax.default_backend() == "cpu":
        from pallas_kernels import cpu_build
        f32, int8 = "f32_matmul/f32_matmul.cc", "quantized_matmul/int8_matmul.cc"
        # the load lays weights out for the matmuls (int8: quantized, then the float ones);
        # the first step compiles need the attention and the KV pool's allocator
        matmuls = (int8, f32) if quantization == "int8" else (f32,)
        cpu_build.build_all_in_background(first=(*matmuls, "attention/paged_attention.cc", "alloc/uninitialized.cc"),
                                          low_priority=True)
    import_transformers_in_background()


def use_compilation_cache(path: str | None) -> None:
    """EngineConfig.compilation_cache_dir: on by default, in the documented location unless
    the process already chose one (tests, an embedding application); None / "" = off."""
    from jaxinfer.engine_config import DEFAULT_COMPILATION_CACHE

    if not path or (path == DEFAULT_COMPILATION_CACHE and _configured_cache_dir()):
        return
    enable_compilation_cache(os.path.expanduser(path))


def _configured_cache_dir() -> str | None:
    import jax

    return jax.config.jax_compilation_cache_dir


def enable_compilation_cache(path: str) -> None:
    """JAX's persistent compilation cache: a warm start loads executables from disk."""
    import jax

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

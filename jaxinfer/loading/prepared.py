"""The single-device model as the engine runs it, from the weight cache when a previous
start saved it (loading/weight_cache.py), else loaded and prepared one tensor at a time.

Loaded from the source, the checkpoint is read lazily (loading/lazy.py) and prepared in
place (quantization.prepare_for_engine): each weight's float form is freed as soon as its
final form exists, so the load never holds two copies of the model.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import jax

from jaxinfer.loading import LoadedModel, load_model, model_path, read_config
from jaxinfer.loading import weight_cache

log = logging.getLogger("jaxinfer")


def load_prepared(model: str | None, dtype: str, quantization: str | None,
                  cache_dir: str | None, codes: bool = True) -> LoadedModel:
    """``model`` (as for load_model) loaded, quantized or laid out for the CPU kernels
    (``codes``: EngineConfig.weight_codes); through the weight cache ``cache_dir``
    (EngineConfig.weight_cache_dir) unless it is None / ""."""
    from jaxinfer.host_memory import map_large_blocks, release_host_memory
    from jaxinfer.quantization import prepare_for_engine, weight_finisher

    t0 = time.perf_counter()
    cache_dir = weight_cache.resolve_dir(cache_dir)
    source = model_path(model)
    options = {"dtype": dtype, "quantization": quantization, "weight_codes": codes}
    key = weight_cache.cache_key(source, options) if cache_dir else None
    layout = lambda: kernel_layout(quantization, dtype)      # noqa: E731  (asked only when needed)
    if key:
        hit = weight_cache.load(cache_dir, key, layout)
        if hit is not None:
            hit.load_seconds = time.perf_counter() - t0
            log.info("weights from the cache %s/%s (%.1fs)", cache_dir, key, hit.load_seconds)
            return hit
    map_large_blocks()
    # each weight in its final form as it is read (quantized, or panelled and coded): the
    # float32 model is never whole in memory
    finish = weight_finisher(read_config(model), quantization, codes)
    loaded = load_model(model, dtype, finish=finish)
    loaded.model = prepare_for_engine(loaded.model, quantization, in_place=True, codes=codes)
    release_host_memory()
    if key and weight_cache.save(cache_dir, key, loaded, options, layout()):
        # Serve from the saved entry's mapped files, as every later start does: the prepared
        # arrays were made in the load's heap among its freed scratch, and the pages they
        # share with it stay resident for the life of the server (int8 default model: -60 MiB).
        hit = weight_cache.load(cache_dir, key, layout)
        if hit is not None:
            loaded = hit
    # The load's one-off jitted helpers (quantize, transposes, stacking: ~30 small
    # executables and their traces) would stay in jax's caches: another ~40 MiB.
    jax.clear_caches()
    release_host_memory()
    loaded.load_seconds = time.perf_counter() - t0
    return loaded


def kernel_layout(quantization: str | None, dtype: str) -> dict[str, Any]:
    """Which CPU kernel lays out the prepared weights (its layout is used only where it is
    built): asked after loading, so a first start's kernel builds overlap the load."""
    if jax.default_backend() != "cpu":
        return {}
    from pallas_kernels.f32_matmul import cpu as cpu_f32_matmul

    if quantization:
        # the f32 kernel: a quantized model's embedding table kept as codes
        # (quantization.code_embedding)
        layout = {"f32_kernel": cpu_f32_matmul.available()}
        if quantization in ("int8", "int4"):       # int4: the same kernel's 4-bit panels
            from pallas_kernels.quantized_matmul import cpu as cpu_matmul
            layout["int8_kernel"] = cpu_matmul.available()
        return layout
    return {"f32_kernel": cpu_f32_matmul.available()} if dtype == "float32" else {}

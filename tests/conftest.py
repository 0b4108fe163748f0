"""Shared pytest fixtures."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    """Path of the default model's GGUF (SmolLM2-135M-Instruct Q4_1); skips if not installed."""
    from jaxinfer.loading.default import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def pytest_configure(config):
    """One persistent XLA compilation cache and one weight cache for the whole run, shared
    by the xdist workers (pyproject's addopts run two) and the subprocesses tests start:
    engines and generators built by different tests compile identical executables once
    (the cold-start figure is measured by benchmarks, not here), and the user's own caches
    are left alone."""
    import tempfile

    # Under xdist each worker would run torch's (and OpenBLAS's) threads on every core, and
    # their OpenMP threads spin while they wait: two workers on two cores then fight, and the
    # HF oracles ran 8x slower in CI than alone (test_default_model's greedy test: 583 s vs
    # 71 s). Each worker gets its share of the cores instead (the engine's own threads are
    # XLA's pool, which this leaves alone).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = str(max(1, (os.cpu_count() or 1) // workers))
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, share)

    from jaxinfer.engine.resources import enable_compilation_cache

    # The first pytest process (xdist's controller, or the only one) makes the directory and
    # removes it when the run ends (pytest_unconfigure; ~0.6-1.1 GB: compiled executables,
    # weight caches, the HF twin of tests/test_default_model.py); the xdist workers it
    # starts inherit the variable and share it.
    path = os.environ.get("JAXINFER_TEST_CACHE_DIR")
    if not path:
        path = tempfile.mkdtemp(prefix="jaxinfer-test-cache-")
        os.environ["JAXINFER_TEST_CACHE_DIR"] = path
        config._jaxinfer_owned_cache = path
    enable_compilation_cache(path)
    from jaxinfer.loading.weight_cache import use_default_dir

    use_default_dir(os.path.join(path, "weights"))
    # ... and every process a test starts (the TP / PP workers, `jaxinfer serve`) inherits
    # both: JAX reads its options from JAX_* variables, the weight cache from
    # JAXINFER_WEIGHT_CACHE; without them a worker's engine used ~/.cache/jaxinfer.
    os.environ.update(JAX_COMPILATION_CACHE_DIR=path, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
                      JAXINFER_WEIGHT_CACHE=os.path.join(path, "weights"))
    # Engine()'s default warm-up is "background"; tests that want it say so (test_warmup)
    from jaxinfer.engine.warmup import use_default_mode

    use_default_mode("full")
    # Each test process builds the C++ kernels now, at its own priority: an Engine() would
    # build them at the lowest (cpu_build.build_all_in_background's low_priority, a start's
    # overlap with its load), which the other xdist worker's work starves until the waiting
    # engine gives up and rebuilds them (cpu_build.STARVED_AFTER_S).
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None):
        from pallas_kernels import cpu_build

        cpu_build.build_all_in_background()


def pytest_unconfigure(config):
    owned = getattr(config, "_jaxinfer_owned_cache", None)
    if owned:
        import shutil

        shutil.rmtree(owned, ignore_errors=True)


# Seconds each file took in CI (setup + call + teardown, the "xdist workers' busy time"
# lines of the clean-clone run of 2026-11-27 09:00 UTC; refresh them from a later run's).
# Files are handed to the two workers longest first (pyproject turns xdist's own
# by-test-count order off): a heavy file started last would leave one worker alone.
FILE_SECONDS = {
    "test_lora.py": 158, "test_speculative.py": 155, "test_engine.py": 145, "test_pipeline.py": 140,
    "test_parallel.py": 117, "test_hf_oracle.py": 98, "test_gemma3_real.py": 77, "test_attention_xla.py": 69,
    "test_pallas_attention.py": 67, "test_moe.py": 65, "test_beam_search.py": 65, "test_gemma3.py": 63,
    "test_default_model.py": 60, "test_gpt_families.py": 58, "test_quantization.py": 52,
    "test_prompt_logprobs.py": 47, "test_guided_serving.py": 47, "test_multi_step.py": 46,
    "test_prefix_cache.py": 42, "test_serving_real.py": 39, "test_phi3.py": 39, "test_numerics_hf.py": 37,
    "test_serving_engine.py": 37,
}


def pytest_collection_modifyitems(config, items):
    """Files longest first (FILE_SECONDS; unknown files after them, in collection order),
    tests within a file in their own order."""
    def weight(item) -> float:
        return FILE_SECONDS.get(item.nodeid.split("::")[0].split("/")[-1], 0.0)

    items[:] = sorted(items, key=lambda it: -weight(it))      # stable: ties keep their order


# Seconds this process spent in XLA compiles (persistent-cache hits included: their load
# time) and in tracing + lowering, per test: attached to each report so the controller can
# sum them per file under xdist (the busy-time lines below say how much of CI is compiling).
_JAX_SECONDS = {"compile": 0.0, "trace": 0.0, "load": 0.0}
_JAX_EVENTS = {"/jax/core/compile/backend_compile_duration": "compile",
               "/jax/core/compile/jaxpr_trace_duration": "trace",
               "/jax/core/compile/jaxpr_to_mlir_module_duration": "trace",
               "/jax/compilation_cache/cache_retrieval_time_sec": "load"}


def _on_jax_event(name: str, secs: float, fun_name: str = "?", **_) -> None:
    kind = _JAX_EVENTS.get(name)
    if kind:
        _JAX_SECONDS[kind] += secs
        if kind == "compile":      # per jitted function: what the compile seconds are spent on
            _JAX_SECONDS[f"compile:{fun_name}"] = _JAX_SECONDS.get(f"compile:{fun_name}", 0.0) + secs


def pytest_sessionstart(session):
    import jax

    jax.monitoring.register_event_duration_secs_listener(_on_jax_event)


_JAX_SECONDS_REPORTED = dict(_JAX_SECONDS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report carries the jax seconds spent since the previous report."""
    outcome = yield
    rep = outcome.get_result()
    rep.user_properties.extend((f"jax_{k}_s", v - _JAX_SECONDS_REPORTED.get(k, 0.0))
                               for k, v in list(_JAX_SECONDS.items()))
    _JAX_SECONDS_REPORTED.update(_JAX_SECONDS)


def pytest_terminal_summary(terminalreporter):
    """Under xdist, each worker's busy time and the files it ran longest: CI's wall time is
    the busier worker's, so this shows how far the split is from even (tuning CI's time)."""
    busy: dict[str, float] = {}
    per_file: dict[tuple[str, str], float] = {}
    compile_s: dict[str, float] = {}
    trace_s: dict[str, float] = {}
    per_file_compile: dict[tuple[str, str], float] = {}
    per_fn: dict[str, float] = {}
    load_s: dict[str, float] = {}
    per_test: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            gw = getattr(getattr(getattr(r, "node", None), "gateway", None), "id", None)
            if gw is None or not hasattr(r, "duration"):
                continue
            busy[gw] = busy.get(gw, 0.0) + r.duration
            key = (gw, r.nodeid.split("::")[0])
            per_file[key] = per_file.get(key, 0.0) + r.duration
            for name, secs in getattr(r, "user_properties", ()):
                if name == "jax_compile_s":
                    compile_s[gw] = compile_s.get(gw, 0.0) + secs
                    per_test[r.nodeid] = per_test.get(r.nodeid, 0.0) + secs
                    per_file_compile[key] = per_file_compile.get(key, 0.0) + secs
                elif name == "jax_load_s":
                    load_s[gw] = load_s.get(gw, 0.0) + secs
                elif name == "jax_trace_s":
                    trace_s[gw] = trace_s.get(gw, 0.0) + secs
                elif name.startswith("jax_compile:"):
                    fn = name[len("jax_compile:"):-2]
                    per_fn[fn] = per_fn.get(fn, 0.0) + secs
    if os.environ.get("JAXINFER_TEST_PROFILE"):     # every test's seconds, for tuning CI
        import json

        rows = [{"nodeid": r.nodeid, "when": r.when, "duration": r.duration,
                 "worker": getattr(getattr(getattr(r, "node", None), "gateway", None), "id", None),
                 **{k: v for k, v in getattr(r, "user_properties", ()) if k.startswith("jax_")}}
                for reports in terminalreporter.stats.values() for r in reports if hasattr(r, "duration")]
        with open(os.environ["JAXINFER_TEST_PROFILE"], "w") as f:
            json.dump(rows, f)
    if not busy:
        return
    terminalreporter.write_sep("=", "xdist workers' busy time")
    for gw in sorted(busy):
        top = sorted(((t, f) for (g, f), t in per_file.items() if g == gw), reverse=True)
        files = ", ".join(f"{f.split('/')[-1]} {t:.0f}" for t, f in top[:40])
        terminalreporter.write_line(f"{gw}: {busy[gw]:.0f} s in tests ({files})")
        top = sorted(((t, f) for (g, f), t in per_file_compile.items() if g == gw), reverse=True)
        files = ", ".join(f"{f.split('/')[-1]} {t:.0f}" for t, f in top[:15])
        terminalreporter.write_line(f"{gw}: of which XLA compiles / cache loads {compile_s.get(gw, 0):.0f} s "
                                    f"({load_s.get(gw, 0):.0f} s of it persistent-cache loads), "
                                    f"tracing + lowering {trace_s.get(gw, 0):.0f} s ({files})")
    fns = ", ".join(f"{f} {t:.0f}" for f, t in sorted(per_fn.items(), key=lambda kv: -kv[1])[:12])
    terminalreporter.write_line(f"compile / cache-load seconds by jitted function, both workers: {fns}")
    for t, n in sorted(((t, n) for n, t in per_test.items()), reverse=True)[:15]:
        terminalreporter.write_line(f"  {t:6.1f} s compiling  {n}")

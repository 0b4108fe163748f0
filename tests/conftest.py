"""Shared pytest fixtures."""

from __future__ import annotations

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
    """One persistent XLA compilation cache for the whole run, shared by the xdist workers
    (pyproject's addopts run two) and the subprocesses tests start: engines and generators
    built by different tests compile identical executables once (the cold-start figure is
    measured by benchmarks, not here)."""
    import os
    import tempfile

    from jaxinfer.engine.resources import enable_compilation_cache

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run:
        path = os.path.join(tempfile.gettempdir(), f"jaxinfer-xla-cache-{run}")
    else:
        path = tempfile.mkdtemp(prefix="jaxinfer-xla-cache-")
    enable_compilation_cache(path)

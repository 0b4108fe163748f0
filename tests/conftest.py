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
    """One persistent XLA compilation cache for the whole session: engines and generators
    built by different tests compile identical executables once (the cold-start figure is
    measured by benchmarks, not here)."""
    import tempfile

    from jaxinfer.engine.engine import enable_compilation_cache

    enable_compilation_cache(tempfile.mkdtemp(prefix="jaxinfer-xla-cache-"))

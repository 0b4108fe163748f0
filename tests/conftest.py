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

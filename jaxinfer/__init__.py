"""jaxinfer: LLM inference and serving on JAX/XLA.

``from jaxinfer import Engine, SamplingParams``. Heavy modules load lazily, so the host-only
parts (the config records, scheduler, block manager) never pull in jax.
"""

from jaxinfer.engine_config import EngineConfig
from jaxinfer.models.config import ModelConfig
from jaxinfer.outputs import CompletionOutput, Logprob, RequestOutput
from jaxinfer.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "CompletionOutput", "Engine", "EngineConfig", "Logprob", "ModelConfig",
           "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Engine":
        from jaxinfer.engine.engine import Engine
        return Engine
    if name == "AsyncEngine":
        from jaxinfer.engine.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")

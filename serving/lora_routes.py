"""Loading and unloading LoRA adapters while serving (vLLM's routes and bodies).

  POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}
  POST /v1/unload_lora_adapter  {"lora_name": "sql"}

Both need the API key like every other route. The adapter directory is read on the
server's file system (its files are validated, never unpickled; engine/lora.py), and only
under the directories the operator allowed (``--lora-dir``, ``build_app(lora_dirs=...)``):
``lora_path`` is resolved (symlinks, ``..``; relative: to the first allowed directory) and
every path outside them gets the same answer, so the route tells a client nothing about the
rest of the file system. No allowed directories: loading by path is refused (adapters the
operator names at start-up, ``--lora-modules``, load from anywhere). Reading runs in a worker
thread, so requests in flight keep streaming. A loaded adapter is served
under its name: OpenAI routes take it as ``model`` (``/v1/models`` lists it with the base
model as ``parent``), TGI routes as ``parameters.adapter_id``. Unloading refuses new
requests for the name at once; requests already running on it finish.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import PlainTextResponse, Response

from jaxinfer.engine.lora import confine_path
from serving.errors import ProtocolError, bad
from serving.fields import Fields, short

MAX_BODY_BYTES = 16 * 1024     # a name and a path


def _lora_api(engine: Any) -> Any:
    if not hasattr(engine, "load_lora"):
        raise ProtocolError("this server does not serve LoRA adapters", status=400, code="lora_disabled")
    return engine


def _fields(body: dict, *names: str) -> list[str]:
    f = Fields(body)
    out = []
    for name in names:
        v = f.str(name)
        if not v:
            raise bad(name, "is required (a non-empty string)")
        out.append(v)
    return out


async def load_lora_adapter(st: Any, engine: Any, body: dict) -> Response:
    """``st``: the app's ServerState; ``body``: the request's JSON object."""
    engine = _lora_api(engine)
    name, path = _fields(body, "lora_name", "lora_path")
    if name in st.model_names():
        raise bad("lora_name", f"{short(name)} is the base model's name")
    try:
        await engine.load_lora(name, confine_path(path, st.lora_dirs))
    except ValueError as e:           # lora.LoraError: outside lora_dirs, bad files, limits, name, LoRA off
        msg = str(e)
        raise ProtocolError(msg, param="lora_name" if msg.startswith("lora_name") else "lora_path",
                              code="invalid_lora_adapter") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(st: Any, engine: Any, body: dict) -> Response:
    engine = _lora_api(engine)
    (name,) = _fields(body, "lora_name")
    try:
        await engine.unload_lora(name)
    except ValueError as e:
        status = 404 if name not in engine.lora_names() and "not enabled" not in str(e) else 400
        raise ProtocolError(str(e), param="lora_name", status=status, code="lora_adapter_not_found"
                              if status == 404 else "invalid_lora_adapter") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def adapter_names(engine: Any) -> tuple[str, ...]:
    """The engine's loaded adapters (none for engines without LoRA)."""
    names = getattr(engine, "lora_names", None)
    return tuple(names()) if names is not None and engine is not None else ()

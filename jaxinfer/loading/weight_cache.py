"""The model as the engine runs it, saved by a first start and memory-mapped by later ones.

A GGUF file must be dequantized and every weight fused, laid out in panels or quantized
(quantization.py) before the engine can use it: ~8 s of a quiet 2-core machine's start
for the 135M default model, repeated at every start. ``save`` writes the finished weights
(one ``.npy`` per array: numpy's own format, 64-byte aligned data, read without pickle),
the tokenizer and the configs into ``<cache>/<key>/``; ``load`` maps the arrays and hands
them to jax without copying (on CPU a page-aligned read-only array becomes the buffer
itself), so a warm start reads nothing it does not use and holds one copy of the weights.

The key covers everything the saved bytes depend on: the source files (path, size and
modification time of each), the options (dtype, quantization, which CPU kernels lay the
weights out), jax's version and backend, this format's version, and the source code of the
modules that load and prepare weights (any change there makes a new key). Entries are
written to a temporary directory and renamed into place, so a reader never sees half of
one; a new entry for a source replaces the older ones of that source.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from jaxinfer.loading import LoadedModel
from jaxinfer.loading.tokenizer import Tokenizer

log = logging.getLogger("jaxinfer")

FORMAT_VERSION = 1
META = "weights.json"
# The containers a prepared weight may be: name -> class (fields: arrays or JSON scalars).
_CONTAINERS: dict[str, type] = {}


def _containers() -> dict[str, type]:
    if not _CONTAINERS:
        from pallas_kernels.cpu_f32_matmul import PanelledF32
        from pallas_kernels.quantized_matmul import QuantizedWeight

        _CONTAINERS.update(PanelledF32=PanelledF32, QuantizedWeight=QuantizedWeight)
    return _CONTAINERS


def cache_key(source: str, options: dict[str, Any]) -> str:
    """The entry name for ``source`` (a file or a directory) prepared with ``options``."""
    h = hashlib.sha256()
    h.update(json.dumps({"format": FORMAT_VERSION, "jax": jax.__version__,
                         "backend": jax.default_backend(), **options}, sort_keys=True).encode())
    for path in _source_files(source):
        st = os.stat(path)
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    h.update(_code_digest())
    return h.hexdigest()[:24]


def _source_files(source: str) -> list[str]:
    source = os.path.realpath(source)
    if os.path.isfile(source):
        return [source]
    return sorted(os.path.join(d, f) for d, _, files in os.walk(source) for f in files)


def _code_digest() -> bytes:
    """The source of the modules whose code decides the prepared bytes."""
    import jaxinfer
    import pallas_kernels

    top, kernels = Path(jaxinfer.__file__).parent, Path(pallas_kernels.__file__).parent
    files = [*sorted((top / "loading").glob("*.py")), *sorted((top / "models").glob("*.py")),
             top / "quantization.py", top / "config.py",
             *(kernels / f"{m}.py" for m in ("cpu_f32_matmul", "cpu_matmul", "quantized_matmul"))]
    return hashlib.sha256(b"\0".join(f.read_bytes() for f in files)).digest()


# ------------------------------------------------------------------------------ save
def save(root: str, key: str, loaded: LoadedModel, layout: dict[str, Any]) -> Path | None:
    """Write ``loaded`` under ``root/key``; None (with the reason logged) if it cannot be
    cached: a model holding other state than weights, or a write that fails. ``layout``:
    what ``load`` must find again (which kernels laid the weights out)."""
    root_path = Path(os.path.expanduser(root))
    try:
        _private_dir(root_path)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root_path))
        try:
            _write(tmp, loaded, layout)
            os.replace(tmp, root_path / key)
        except OSError:
            if not (root_path / key / META).exists():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, ValueError) as e:
        log.warning("weight cache: not saved (%s)", e)
        return None
    _drop_older(root_path, key, loaded.source)
    return root_path / key


def _write(d: Path, loaded: LoadedModel, layout: dict[str, Any]) -> None:
    weights = []
    for i, (path, var) in enumerate(_variables(loaded.model)):
        if type(var) is not nnx.Param:
            raise ValueError(f"{'.'.join(map(str, path))} is a {type(var).__name__}, not a weight")
        entry = {"path": list(path), "arrays": {}, "static": {}}
        value = var.get_value()
        if isinstance(value, jax.Array):
            entry["type"], fields = "array", {"": value}
        else:
            entry["type"] = type(value).__name__
            if _containers().get(entry["type"]) is not type(value):
                raise ValueError(f"{'.'.join(map(str, path))} holds a {entry['type']}")
            fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        for name, x in fields.items():
            if isinstance(x, jax.Array):
                fn = f"{i:04d}{'.' + name if name else ''}.npy"
                np.save(d / fn, np.asarray(x), allow_pickle=False)
                entry["arrays"][name] = {"file": fn, "dtype": str(x.dtype)}
            else:
                entry["static"][name] = x
        weights.append(entry)
    tok = loaded.tokenizer
    tok.hf.save_pretrained(str(d / "tokenizer"))
    meta = {"format_version": FORMAT_VERSION, "source": loaded.source, "layout": layout, "hf_config": loaded.hf_config,
            "generation_config": loaded.generation_config, "dtype": jax.numpy.dtype(loaded.model.dtype).name,
            "tokenizer": {"eos_token_ids": list(tok.eos_token_ids), "vocab_size": tok.vocab_size},
            "weights": weights}
    (d / META).write_text(json.dumps(meta))


def _variables(model: nnx.Module) -> list[tuple[tuple, nnx.Variable]]:
    return [(p, v) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)]


def _drop_older(root: Path, key: str, source: str) -> None:
    """Remove the other entries of ``source`` (an older file, other code): one per source."""
    for entry in root.iterdir():
        if entry.name == key or entry.name.startswith("."):
            continue
        try:
            if json.loads((entry / META).read_text()).get("source") == source:
                shutil.rmtree(entry, ignore_errors=True)
        except (OSError, ValueError):
            continue


def _private_dir(path: Path) -> None:
    """Create ``path`` 0700; refuse one another user owns or can write (its weights would
    be someone else's)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"{path} is not a directory only this user can write")


# ------------------------------------------------------------------------------ load
def load(root: str, key: str, layout: Callable[[], dict[str, Any]]) -> LoadedModel | None:
    """The entry ``root/key`` as a LoadedModel (arrays memory-mapped), or None if there is
    none, it was laid out for other kernels than ``layout()`` says are here (asked only
    when there is an entry: it may wait for a kernel build), or it is unreadable (logged;
    the caller loads from the source instead)."""
    d = Path(os.path.expanduser(root)) / key
    if not (d / META).is_file():
        return None
    try:
        _private_dir(d.parent)
        return _read(d, layout)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("weight cache: %s unreadable, loading from the source (%s)", d, e)
        return None


def _read(d: Path, layout: Callable[[], dict[str, Any]]) -> LoadedModel | None:
    from jaxinfer.config import ModelConfig
    from jaxinfer.loading import resolve_dtype
    from jaxinfer.models.registry import model_class

    meta = json.loads((d / META).read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"format {meta.get('format_version')}, not {FORMAT_VERSION}")
    here = layout()
    if meta.get("layout") != here:
        log.info("weight cache: %s was laid out for kernels %s, here %s", d, meta.get("layout"), here)
        return None
    cfg = ModelConfig.from_hf(meta["hf_config"])
    dtype = resolve_dtype(meta["dtype"])
    model = nnx.eval_shape(lambda: model_class(cfg.architecture)(cfg, dtype, rngs=nnx.Rngs(0)))
    placed = set()
    for w in meta["weights"]:
        *owner_path, attr = w["path"]
        owner = model
        for part in owner_path:
            owner = owner[part] if isinstance(part, int) else getattr(owner, part)
        setattr(owner, attr, nnx.Param(_value(d, w)))
        placed.add(tuple(w["path"]))
    # weights the preparation replaced (fused q/k/v parts) are still abstract: drop them
    for path, var in _variables(model):
        if path not in placed:
            *owner_path, attr = path
            owner = model
            for part in owner_path:
                owner = owner[part] if isinstance(part, int) else getattr(owner, part)
            delattr(owner, attr)
    t = meta["tokenizer"]
    tokenizer = Tokenizer.from_saved(str(d / "tokenizer"), t["eos_token_ids"], t["vocab_size"])
    return LoadedModel(cfg, model, tokenizer, meta["generation_config"], meta["source"], meta["hf_config"])


def _value(d: Path, w: dict[str, Any]) -> Any:
    arrays = {}
    for name, a in w["arrays"].items():
        host = np.load(d / a["file"], mmap_mode="r", allow_pickle=False)
        if str(host.dtype) != a["dtype"]:          # bfloat16 is saved as raw 2-byte records
            host = host.view(jax.numpy.dtype(a["dtype"]))
        arrays[name] = jax.device_put(host)        # CPU: the mapped pages, not a copy
    if w["type"] == "array":
        return arrays[""]
    cls = _containers()[w["type"]]
    return cls(**arrays, **w["static"])

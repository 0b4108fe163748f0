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

from jaxinfer.loading.model import LoadedModel
from jaxinfer.loading.tokenizer import Tokenizer

log = logging.getLogger("jaxinfer")

# 2: a tied int8 model's embedding is a reference to its int8 LM head (one table, not two);
# an entry of an older format is prepared again once and replaced.
FORMAT_VERSION = 2
META = "weights.json"
MAX_ENTRIES = 6          # the most recently used entries kept (each a model's weights)
_default_dir: str | None = None
# The containers a prepared weight may be: name -> class (fields: arrays or JSON scalars).
_CONTAINERS: dict[str, type] = {}


def _containers() -> dict[str, type]:
    if not _CONTAINERS:
        from jaxinfer.quantization import TiedEmbedding
        from pallas_kernels.f32_matmul.cpu import CodedF32, PanelledF32
        from pallas_kernels.quantized_matmul.xla import QuantizedWeight

        _CONTAINERS.update(PanelledF32=PanelledF32, CodedF32=CodedF32, QuantizedWeight=QuantizedWeight,
                           TiedEmbedding=TiedEmbedding)
    return _CONTAINERS


def use_default_dir(path: str) -> None:
    """Where EngineConfig's default weight cache lives in this process (tests: a
    temporary directory, as for XLA's compilation cache); an explicit one is kept."""
    global _default_dir
    _default_dir = path


def resolve_dir(configured: str | None) -> str | None:
    """The directory EngineConfig.weight_cache_dir names (None: off). The default one is
    ``use_default_dir``'s, else ``$JAXINFER_WEIGHT_CACHE``, else ~/.cache/jaxinfer/weights."""
    from jaxinfer.engine_config import DEFAULT_WEIGHT_CACHE

    if not configured:
        return None
    if configured == DEFAULT_WEIGHT_CACHE:
        default = _default_dir or os.environ.get("JAXINFER_WEIGHT_CACHE")
        if default:
            return os.path.expanduser(default)
    return os.path.expanduser(configured)


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
    import pallas_kernels

    top, kernels = Path(__file__).resolve().parents[1], Path(pallas_kernels.__file__).parent
    files = [*sorted((top / "loading").glob("*.py")), *sorted((top / "models").glob("*.py")),
             top / "quantization.py",
             *(kernels / m for m in ("f32_matmul/cpu.py", "quantized_matmul/cpu.py", "quantized_matmul/xla.py",
                                     # the codes and the kernel's dequantization that they reproduce
                                     "f32_matmul/codes.py", "f32_matmul/f32_matmul.cc"))]
    return hashlib.sha256(b"\0".join(f.read_bytes() for f in files)).digest()


# ------------------------------------------------------------------------------ save
def save(root: str, key: str, loaded: LoadedModel, options: dict[str, Any],
         layout: dict[str, Any]) -> Path | None:
    """Write ``loaded`` (prepared with ``options``) under ``root/key``; None (with the
    reason logged) if it cannot be cached: a model holding other state than weights, or a
    write that fails. ``layout``: what ``load`` must find again (which kernels laid the
    weights out). Older entries of the same source and options are removed."""
    root_path = Path(os.path.expanduser(root))
    try:
        _private_dir(root_path)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root_path))
        try:
            _write(tmp, loaded, {"options": options, "layout": layout})
            os.replace(tmp, root_path / key)
        except OSError:
            if not (root_path / key / META).exists():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, ValueError) as e:
        log.warning("weight cache: not saved (%s)", e)
        return None
    _drop_older(root_path, key, [loaded.source, options])
    return root_path / key


def _drop_older(root: Path, key: str, what: list) -> None:
    """Remove the other entries of ``what`` ([source, options]: an older file, other code)
    and all but the MAX_ENTRIES most recently used."""
    entries = []
    for entry in root.iterdir():
        if entry.name.startswith("."):
            continue
        try:
            meta = entry / META
            m = json.loads(meta.read_text())
            if entry.name != key and [m.get("source"), m.get("options")] == what:
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entries.append((meta.stat().st_mtime, entry))
        except (OSError, ValueError):
            continue
    for _, entry in sorted(entries, reverse=True)[MAX_ENTRIES:]:
        shutil.rmtree(entry, ignore_errors=True)


def _entry(d: Path, stem: str, name: str, value: Any, held_by: dict) -> dict[str, Any]:
    """How one value is written: its type, its arrays (saved as ``stem[.field].npy``), its
    fields that are another weight's value (``refs``: a tied head), its JSON scalars, and
    its fields that are containers of their own (``nested``: a TiedEmbedding over the
    table's own codes)."""
    entry: dict[str, Any] = {"arrays": {}, "refs": {}, "static": {}, "nested": {}}
    if isinstance(value, jax.Array):
        entry["type"], fields = "array", {"": value}
    else:
        entry["type"] = type(value).__name__
        if _containers().get(entry["type"]) is not type(value):
            raise ValueError(f"{name} holds a {entry['type']}")
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    for field, x in fields.items():
        if _identity(x) in held_by:
            entry["refs"][field] = held_by[_identity(x)]
        elif isinstance(x, jax.Array):
            fn = f"{stem}{'.' + field if field else ''}.npy"
            np.save(d / fn, np.asarray(x), allow_pickle=False)
            entry["arrays"][field] = {"file": fn, "dtype": str(x.dtype)}
        elif isinstance(x, (int, float, str, bool)) or x is None:
            entry["static"][field] = x
        elif dataclasses.is_dataclass(x):
            entry["nested"][field] = _entry(d, f"{stem}.{field}", f"{name}.{field}", x, held_by)
        else:
            raise ValueError(f"{name}.{field} is a {type(x).__name__}")
    return entry


def _write(d: Path, loaded: LoadedModel, extra: dict[str, Any]) -> None:
    weights, held_by = [], {}          # ids of a value's arrays -> path of the weight holding it
    variables = sorted(_variables(loaded.model), key=lambda pv: _depth(pv[1].get_value()))
    for i, (path, var) in enumerate(variables):
        name = ".".join(map(str, path))
        if type(var) is not nnx.Param:
            raise ValueError(f"{name} is a {type(var).__name__}, not a weight")
        value = var.get_value()
        weights.append({"path": list(path), **_entry(d, f"{i:04d}", name, value, held_by)})
        held_by.setdefault(_identity(value), list(path))
    tok = loaded.tokenizer
    tok.hf.save_pretrained(str(d / "tokenizer"))
    meta = {"format_version": FORMAT_VERSION, "source": loaded.source, **extra,
            "hf_config": loaded.hf_config, "generation_config": loaded.generation_config,
            "dtype": jax.numpy.dtype(loaded.model.dtype).name,
            "tokenizer": {"eos_token_ids": list(tok.eos_token_ids), "vocab_size": tok.vocab_size},
            "weights": weights}
    (d / META).write_text(json.dumps(meta))


def _identity(value: Any) -> tuple[int, ...] | None:
    """The arrays a value is made of (nnx hands out a new container object per read)."""
    leaves = jax.tree.leaves(value)
    return tuple(map(id, leaves)) if leaves and all(isinstance(x, jax.Array) for x in leaves) else None


def _depth(value: Any) -> int:
    """0 an array, 1 a container of arrays, 2 a container holding a container: written in
    this order, a value that shares another weight's arrays (TiedEmbedding: the LM head)
    comes after that weight and refers to it."""
    if isinstance(value, jax.Array):
        return 0
    return 1 + any(dataclasses.is_dataclass(getattr(value, f.name)) for f in dataclasses.fields(value))


def _variables(model: nnx.Module) -> list[tuple[tuple, nnx.Variable]]:
    return [(p, v) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)]


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
        loaded = _read(d, layout)
        if loaded is not None:
            os.utime(d / META)           # most recently used (MAX_ENTRIES)
        return loaded
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("weight cache: %s unreadable, loading from the source (%s)", d, e)
        return None


def _read(d: Path, layout: Callable[[], dict[str, Any]]) -> LoadedModel | None:
    from jaxinfer.loading.model import resolve_dtype
    from jaxinfer.models.base import abstract_model
    from jaxinfer.models.registry import config_from_hf, model_class

    meta = json.loads((d / META).read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"format {meta.get('format_version')}, not {FORMAT_VERSION}")
    here = layout()
    if meta.get("layout") != here:
        log.info("weight cache: %s was laid out for kernels %s, here %s", d, meta.get("layout"), here)
        return None
    cfg = config_from_hf(meta["hf_config"])
    dtype = resolve_dtype(meta["dtype"])
    model = abstract_model(model_class(cfg.architecture), cfg, dtype)
    built: dict[tuple, Any] = {}
    for w in meta["weights"]:
        *owner_path, attr = w["path"]
        owner = model
        for part in owner_path:
            owner = owner[part] if isinstance(part, int) else getattr(owner, part)
        built[tuple(w["path"])] = value = _value(d, w, built)
        setattr(owner, attr, nnx.Param(value))
    # weights the preparation replaced (fused q/k/v parts) are still abstract: drop them
    for path, var in _variables(model):
        if path not in built:
            *owner_path, attr = path
            owner = model
            for part in owner_path:
                owner = owner[part] if isinstance(part, int) else getattr(owner, part)
            delattr(owner, attr)
    t = meta["tokenizer"]
    tokenizer = Tokenizer.from_saved(str(d / "tokenizer"), t["eos_token_ids"], t["vocab_size"])
    return LoadedModel(cfg, model, tokenizer, meta["generation_config"], meta["source"], meta["hf_config"])


def _value(d: Path, w: dict[str, Any], built: dict[tuple, Any]) -> Any:
    fields = {name: built[tuple(path)] for name, path in w.get("refs", {}).items()}
    fields.update({name: _value(d, sub, built) for name, sub in w.get("nested", {}).items()})
    for name, a in w["arrays"].items():
        host = np.load(d / a["file"], mmap_mode="r", allow_pickle=False)
        if str(host.dtype) != a["dtype"]:          # bfloat16 is saved as raw 2-byte records
            host = host.view(jax.numpy.dtype(a["dtype"]))
        fields[name] = jax.device_put(host)        # CPU: the mapped pages, not a copy
    if w["type"] == "array":
        return fields[""]
    return _containers()[w["type"]](**fields, **w["static"])

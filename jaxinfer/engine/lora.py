"""Multi-LoRA, the host side: reading PEFT adapters, the registry of loaded adapters, and
the table of device slots (least recently used out first).

An adapter is a PEFT LoRA directory: ``adapter_config.json`` + ``adapter_model.safetensors``
(nothing is unpickled: ``adapter_model.bin`` is refused). Each targeted linear layer W
[in, out] gains ``scaling * (x @ A) @ B`` with A = lora_A.T [in, r], B = lora_B.T [r, out];
``scaling`` (lora_alpha / r, or / sqrt(r) for rsLoRA) is folded into B here, once.

Which modules an adapter may target comes from the model's own weight table: every
q/k/v/o/gate/up/down weight that is one HF linear layer (``WeightSpec.hf_name``; not a
slice of a fused checkpoint tensor) is a target under its HF module name, so the Llama
family, Qwen, Mistral, Gemma 3 and OPT-style models need no table of their own.

Host only (numpy, no jax): the device side, slot arrays and the matmul hook, is
engine/lora_device.py. The scheduler never sees any of this; it sees each sequence's
``lora_id`` (0 = the base model) and a limit on distinct adapters per step.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from jaxinfer.engine_config import EngineConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Our weight names an adapter may target (models' weight tables), in layer order.
TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
MAX_RANK = EngineConfig.MAX_LORA_RANK     # the largest --max-lora-rank
MAX_CONFIG_BYTES = 1 << 20   # adapter_config.json is a few KB
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")
_PREFIX = "base_model.model."
# One answer for every path outside the allowed directories (missing, a file, a directory,
# a symlink out): a client learns nothing about the file system beyond them.
OUTSIDE_ALLOWED = "lora_path: not an adapter directory under the allowed LoRA directories"
NO_ALLOWED_DIRS = ("lora_path: loading adapters over HTTP is off; start the server with --lora-dir DIR "
                   "to allow the adapter directories under DIR")
_OPTION_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")     # a PEFT option's name, safe to repeat

# adapter_config.json keys whose value does not change the adapter's inference math
# (bookkeeping, training-time settings, initialisation methods). Any other key must hold
# its neutral value (null / false / {} / [] / "none"), else the adapter is refused with
# the key's name: DoRA, biases, modules_to_save, rank/alpha patterns, fan_in_fan_out, ...
_INERT_KEYS = frozenset({
    "peft_type", "r", "lora_alpha", "use_rslora", "target_modules", "exclude_modules",
    "layers_to_transform", "layers_pattern", "lora_dropout", "init_lora_weights", "inference_mode",
    "task_type", "base_model_name_or_path", "revision", "peft_version", "auto_mapping",
    "loftq_config", "eva_config", "corda_config", "lora_ga_config", "megatron_core",
    "qalora_group_size", "ensure_weight_tying", "modules_to_save_config"})


class LoraError(ValueError):
    """An adapter that cannot be loaded (bad or unsupported files, wrong shapes, limits)."""


@dataclass(frozen=True, slots=True)
class LoraTarget:
    """One linear layer an adapter may modify: our weight path and its [in, out] shape."""

    path: str                  # "layers.3.wq"
    shape: tuple[int, int]     # [in, out] of the model's weight (before any KV-head repeat)
    axes: tuple[Any, Any]      # the weight's logical axes (sharding.py): A and B follow them


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """A validated adapter as read from disk: our path -> (A f32[in, r], B f32[r, out]),
    B already multiplied by the adapter's scaling."""

    path: str
    rank: int
    weights: Mapping[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A registered adapter. ``lora_id`` is unique per load (never reused), so a prefix-cache
    page computed under one load is never found by a later adapter of the same name."""

    name: str
    lora_id: int
    data: AdapterWeights


def lora_targets(cfg: Any) -> dict[str, LoraTarget]:
    """PEFT module name ("model.layers.3.self_attn.q_proj") -> the target, from the
    model family's weight table (cfg: ModelConfig)."""
    from jaxinfer.models.registry import weight_specs

    out: dict[str, LoraTarget] = {}
    for path, spec in weight_specs(cfg).items():
        if path.rsplit(".", 1)[-1] not in TARGETS or spec.hf_take is not None or not spec.transpose:
            continue               # fused checkpoint tensors and Conv1D-style weights are not targets
        for hf in (spec.hf_name, spec.hf_alt):
            if hf and hf.endswith(".weight"):
                out[hf[:-len(".weight")]] = LoraTarget(path, spec.shape, spec.axes)
    return out


def max_adapter_bytes(cfg: Any, max_rank: int) -> int:
    """The largest adapter_model.safetensors a legitimate adapter of rank <= max_rank can be
    (every target, float32, plus header room): bigger files are refused before reading."""
    per_rank = sum(t.shape[0] + t.shape[1] for t in {t.path: t for t in lora_targets(cfg).values()}.values())
    return max_rank * per_rank * 4 + (1 << 20)


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise LoraError(f"lora_name: {name!r:.80} must be 1-128 characters of letters, digits and "
                        "._:/@+- starting with a letter or digit")
    return name


def read_adapter(path: str, cfg: Any, max_rank: int) -> AdapterWeights:
    """Read and validate a PEFT LoRA directory for a model of ``cfg``; LoraError names what
    is wrong (missing or pickled files, unsupported options, rank, module names, shapes)."""
    if not isinstance(path, str) or not path:
        raise LoraError("lora_path: must be a non-empty string")
    if not os.path.isdir(path):
        if os.path.isfile(path):
            raise LoraError(f"lora_path: {path} is a file; give the adapter's directory (holding "
                            f"{CONFIG_FILE} and {WEIGHTS_FILE})")
        raise LoraError(f"lora_path: {path} is not a directory")
    conf = _read_config(path, max_rank)
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        pickled = [f for f in ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
                   if os.path.exists(os.path.join(path, f))]
        if pickled:
            raise LoraError(f"{path}: {pickled[0]} is a pickle file and is never loaded; save the "
                            f"adapter as {WEIGHTS_FILE} (PEFT: save_pretrained(safe_serialization=True))")
        raise LoraError(f"{path}: {WEIGHTS_FILE} is missing")
    limit = max_adapter_bytes(cfg, max_rank)
    try:
        size = os.path.getsize(weights_path)
    except OSError as e:                      # gone or unreadable since the check above
        raise _unreadable(weights_path, e) from None
    if size > limit:
        raise LoraError(f"{weights_path}: {size} bytes is more than any adapter of rank <= {max_rank} "
                        f"for this model can be ({limit} bytes)")
    r = conf["r"]
    scaling = float(conf["lora_alpha"]) / (math.sqrt(r) if conf.get("use_rslora") else r)
    tensors = _read_tensors(weights_path)
    return AdapterWeights(path, r, _pair_tensors(tensors, lora_targets(cfg), r, scaling, weights_path))


def allowed_dirs(dirs: Iterable[str]) -> tuple[str, ...]:
    """The directories adapters may be loaded from over HTTP (``--lora-dir``) -> their real
    paths (symlinks resolved once, at start-up); ValueError naming one that is not a directory."""
    out = []
    for d in dirs:
        if not isinstance(d, str) or not d or not os.path.isdir(d):
            raise ValueError(f"lora_dirs: {d!r:.200} is not a directory (--lora-dir)")
        out.append(os.path.realpath(d))
    return tuple(out)


def confine_path(path: str, dirs: Sequence[str]) -> str:
    """A client's ``lora_path`` -> its real path, if that lies in one of ``dirs`` (real paths:
    ``allowed_dirs``); a relative path is taken relative to the first. Symlinks and ``..`` are
    resolved before the check, so neither leads out. Anything else is a LoraError with one
    message whatever is there (OUTSIDE_ALLOWED); no dirs at all: loading by path is off."""
    if not dirs:
        raise LoraError(NO_ALLOWED_DIRS)
    try:
        real = os.path.realpath(os.path.join(dirs[0], path))     # an absolute path replaces dirs[0]
    except (OSError, ValueError, TypeError):                   # a NUL byte, not a string
        raise LoraError(OUTSIDE_ALLOWED) from None
    if not any(os.path.commonpath((real, d)) == d for d in dirs):
        raise LoraError(OUTSIDE_ALLOWED)
    return real


def _read_config(path: str, max_rank: int) -> dict[str, Any]:
    """adapter_config.json, validated. Its values are never repeated in an error (only their
    JSON type, or a number): the message goes to an HTTP client, the file stays here."""
    conf_path = os.path.join(path, CONFIG_FILE)
    if not os.path.lexists(conf_path):
        raise LoraError(f"{path}: {CONFIG_FILE} is missing (a PEFT LoRA adapter directory holds "
                        f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    conf = _parse_config(_read_config_bytes(conf_path), conf_path)
    if conf.get("peft_type") != "LORA":
        raise LoraError(f"{conf_path}: peft_type must be 'LORA' (this is not a LoRA adapter), got "
                        f"{_kind(conf.get('peft_type'))}")
    r = conf.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= max_rank:
        raise LoraError(f"{conf_path}: r (the rank) must be an integer in [1, {max_rank}] "
                        f"(--max-lora-rank), got {_kind(r)}")
    alpha = conf.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoraError(f"{conf_path}: lora_alpha must be a number, got {_kind(alpha)}")
    if not isinstance(conf.get("use_rslora", False), bool):
        raise LoraError(f"{conf_path}: use_rslora must be true or false")
    for key, value in conf.items():
        if key not in _INERT_KEYS and value not in (None, False, {}, [], "none", 0):
            what = f"option {key}" if _OPTION_RE.fullmatch(key) else "an option"
            raise LoraError(f"{conf_path}: {what} is set; it is not supported "
                            "(plain LoRA only: no DoRA, biases, modules_to_save, rank/alpha patterns)")
    return conf


def _read_config_bytes(conf_path: str) -> bytes:
    """The file's bytes, at most MAX_CONFIG_BYTES. Opened without blocking and checked on the
    open descriptor to be a regular file, so a FIFO or device in its place can neither hang
    nor flood the reader; every OSError (permissions, a directory, I/O) is a LoraError."""
    try:
        fd = os.open(conf_path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise _unreadable(conf_path, e) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LoraError(f"{conf_path}: is not a regular file")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise _unreadable(conf_path, e) from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise LoraError(f"{conf_path}: larger than {MAX_CONFIG_BYTES} bytes")
    return data


def _unreadable(path: str, e: OSError) -> LoraError:
    """The OS's reason only ("Permission denied"), not the exception's text."""
    return LoraError(f"{path}: cannot be read ({e.strerror or type(e).__name__})")


def _parse_config(data: bytes, conf_path: str) -> dict[str, Any]:
    """JSON object -> dict; the parser's own messages are not passed on (they quote the text)."""
    try:
        conf = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise LoraError(f"{conf_path}: is not UTF-8 text") from None
    except (ValueError, RecursionError):       # bad JSON, nesting past the recursion limit, huge ints
        raise LoraError(f"{conf_path}: is not valid JSON") from None
    if not isinstance(conf, dict):
        raise LoraError(f"{conf_path}: must hold a JSON object")
    return conf


def _kind(value: Any) -> str:
    """A config value for an error message: a number as itself, anything else only by its JSON
    type (a string could be any file's text)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value!r:.40}"
    names = {type(None): "null", bool: "a boolean", str: "a string", list: "an array", dict: "an object"}
    return names.get(type(value), "a value of another type")


def _read_tensors(weights_path: str) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError, safe_open

    out: dict[str, np.ndarray] = {}
    try:
        with safe_open(weights_path, framework="numpy") as f:
            for name in f.keys():
                out[name] = np.asarray(f.get_tensor(name))
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise LoraError(f"{weights_path}: corrupt or unreadable safetensors file ({e})") from None
    return out


def _pair_tensors(tensors: dict[str, np.ndarray], targets: dict[str, LoraTarget], r: int,
                  scaling: float, where: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    halves: dict[str, dict[str, np.ndarray]] = {}
    for name, arr in tensors.items():
        m = re.fullmatch(r"(.+)\.lora_([AB])\.weight", name)
        module = m.group(1)[len(_PREFIX):] if m and m.group(1).startswith(_PREFIX) else None
        if module is None:
            raise LoraError(f"{where}: tensor {name!r:.120} is not a LoRA A/B weight "
                            f"('{_PREFIX}<module>.lora_A.weight'); embeddings, biases and DoRA "
                            "magnitudes are not supported")
        if module not in targets:
            raise LoraError(f"{where}: module {module!r:.120} is not a LoRA target of this model "
                            f"(targets: q/k/v/o/gate/up/down projections, e.g. {next(iter(targets), '-')!r})")
        if arr.dtype.kind != "f" or arr.ndim != 2:
            raise LoraError(f"{where}: {name} must be a 2-D float tensor, got {arr.dtype} {arr.shape}")
        halves.setdefault(module, {})[m.group(2)] = arr
    if not halves:
        raise LoraError(f"{where}: holds no LoRA weights")
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for module, ab in halves.items():
        t = targets[module]
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{where}: {module} has lora_{''.join(ab)} but not both lora_A and lora_B")
        (n_in, n_out), a, b = t.shape, ab["A"], ab["B"]
        if a.shape != (r, n_in) or b.shape != (n_out, r):
            raise LoraError(f"{where}: {module}: lora_A {a.shape} / lora_B {b.shape} do not fit rank "
                            f"r={r} and the model's [{n_out}, {n_in}] weight (want A ({r}, {n_in}), "
                            f"B ({n_out}, {r}))")
        a32, b32 = a.astype(np.float32).T, b.astype(np.float32).T * np.float32(scaling)
        if not (np.isfinite(a32).all() and np.isfinite(b32).all()):
            raise LoraError(f"{where}: {module} holds NaN or infinite values")
        out[t.path] = (np.ascontiguousarray(a32), np.ascontiguousarray(b32))
    return out


def make_registry(cfg: Any, config: Any, num_processes: int = 1) -> "LoraRegistry | None":
    """The engine's registry (cfg: the model's ModelConfig, config: EngineConfig) with its
    ``lora_modules`` loaded, or None when LoRA is off."""
    if not config.enable_lora:
        return None
    if num_processes > 1:
        raise ValueError("enable_lora: LoRA adapters run in one process for now (followers would "
                         "not receive the adapters' weights)")
    reg = LoraRegistry(cfg, config.max_lora_rank, config.max_cpu_loras)
    for name, path in config.lora_modules:
        reg.load(name, path)
    return reg


class LoraRegistry:
    """Adapters by name, thread-safe (the server loads and unloads while the engine steps).

    Unloading removes the name at once (new requests for it are refused) while the requests
    already running on it finish with its weights: an adapter lives until its last
    reference (``acquire`` / ``release``, one per request) is gone."""

    def __init__(self, cfg: Any, max_rank: int, max_adapters: int):
        self.cfg = cfg
        self.max_rank = max_rank
        self.max_adapters = max_adapters
        self._lock = threading.Lock()
        self._by_name: dict[str, LoraAdapter] = {}
        self._by_id: dict[int, LoraAdapter] = {}      # loaded, or unloaded but still referenced
        self._refs: dict[int, int] = {}
        self._next_id = 1

    def read(self, path: str) -> AdapterWeights:
        """The adapter at ``path`` read and validated (the slow part; any thread)."""
        return read_adapter(path, self.cfg, self.max_rank)

    def add(self, name: str, data: AdapterWeights) -> LoraAdapter:
        check_name(name)
        with self._lock:
            if name in self._by_name:
                raise LoraError(f"lora_name: an adapter named {name!r} is already loaded "
                                "(unload it first)")
            if len(self._by_name) >= self.max_adapters:
                raise LoraError(f"lora: {self.max_adapters} adapters are loaded, the most this engine "
                                "holds (--max-cpu-loras); unload one first")
            adapter = LoraAdapter(name, self._next_id, data)
            self._next_id += 1
            self._by_name[name] = adapter
            self._by_id[adapter.lora_id] = adapter
            return adapter

    def load(self, name: str, path: str) -> LoraAdapter:
        check_name(name)
        return self.add(name, self.read(path))

    def remove(self, name: str) -> LoraAdapter:
        with self._lock:
            adapter = self._by_name.pop(name, None)
            if adapter is None:
                raise LoraError(f"lora_name: no adapter named {name!r:.80} is loaded")
            if not self._refs.get(adapter.lora_id):
                del self._by_id[adapter.lora_id]
            return adapter

    def by_id(self, lora_id: int) -> LoraAdapter:
        with self._lock:
            return self._by_id[lora_id]

    def names(self) -> list[str]:
        with self._lock:
            return list(self._by_name)

    def acquire(self, name: str, n: int = 1) -> int:
        """``n`` references to the adapter loaded as ``name`` (one per sequence) -> its
        lora_id; LoraError when no such adapter is loaded."""
        with self._lock:
            adapter = self._by_name.get(name) if isinstance(name, str) else None
            if adapter is not None:
                self._refs[adapter.lora_id] = self._refs.get(adapter.lora_id, 0) + n
                return adapter.lora_id
        loaded = self.names()
        raise LoraError(f"lora: no adapter named {name!r:.80} is loaded"
                        + (f" (loaded: {', '.join(loaded)})" if loaded else ""))

    def release(self, lora_id: int, n: int = 1) -> None:
        """``n`` references fewer; an unloaded adapter is dropped with its last one."""
        with self._lock:
            n = self._refs.get(lora_id, 0) - n
            if n > 0:
                self._refs[lora_id] = n
                return
            self._refs.pop(lora_id, None)
            adapter = self._by_id.get(lora_id)
            if adapter is not None and self._by_name.get(adapter.name) is not adapter:
                del self._by_id[lora_id]

    def is_live(self, lora_id: int) -> bool:
        with self._lock:
            return lora_id in self._by_id


class SlotTable:
    """Which adapter each of ``num_slots`` device slots holds (slot 0 is "no adapter" and
    holds nothing; slots 1..num_slots are the device arrays' slots), least recently used
    evicted first. Host only: the caller writes the weights of every slot ``assign`` hands
    out before the step that uses it."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"max_loras: must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()   # lora_id -> slot, LRU first
        self._free = list(range(num_slots, 0, -1))

    def assign(self, lora_ids: set[int]) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for every id in ``lora_ids`` (0 = none, slot 0) -> (lora_id -> slot, the
        (slot, lora_id) loads to do now). Raises if more distinct adapters than slots are
        asked for (the scheduler admits at most num_slots per step)."""
        want = [i for i in lora_ids if i]
        if len(want) > self.num_slots:
            raise RuntimeError(f"{len(want)} adapters in one step, but only {self.num_slots} slots")
        loads = []
        for i in want:
            if i in self._slot_of:
                self._slot_of.move_to_end(i)
        for i in sorted(want):
            if i in self._slot_of:
                continue
            if not self._free:
                victim = next(v for v in self._slot_of if v not in lora_ids)   # least recent unused
                self._free.append(self._slot_of.pop(victim))
            slot = self._free.pop()
            self._slot_of[i] = slot
            loads.append((slot, i))
        return {i: (self._slot_of[i] if i else 0) for i in lora_ids}, loads

    def forget(self, lora_id: int) -> None:
        """Free ``lora_id``'s slot (its adapter is gone)."""
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            self._free.append(slot)

    def resident(self) -> dict[int, int]:
        return dict(self._slot_of)

"""The CPU int8 weight-only matmul: a C++ kernel (cpu/int8_matmul.cc) called through jax.ffi.

XLA:CPU converts int8 weights to f32 in memory before its dot, so int8 weights streamed no
fewer bytes than f32 ones (RESULTS.md, "Quantized matmul on CPU"). The kernel reads only
the int8 bytes: on packed weights it multiplies them with int16-quantized activations
(per row and block of 64) in exact int32 block sums, on plain ones it converts to f32 in
registers. Either way an output depends on its own row only and is summed in one fixed
order, so it is bitwise batch-invariant by construction (see the .cc header) and serves
both the plain and the batch-invariant engine.

The kernel is compiled on first use with the host's C++ compiler (``$CXX``, default
``g++``; ``-O3 -march=native``; x86-64 with AVX2 and FMA) against the XLA FFI headers that jaxlib ships, and cached
under ``$JAXINFER_KERNEL_CACHE`` (default ``~/.cache/jaxinfer/kernels``) by a hash of the
source, the jaxlib version, the compiler and the CPU's flags. Without a compiler,
``available()`` is False with the reason in ``unavailable_reason()`` and the engine keeps
the XLA path (attention/dispatch.py logs which one it took).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_matmul import QuantizedWeight

log = logging.getLogger("jaxinfer")

TARGET = "jaxinfer_int8_matmul"
SOURCE = Path(__file__).with_name("cpu") / "int8_matmul.cc"
# -mno-avx512f: the kernel's one code path is AVX2 + FMA (tested), even on AVX-512 hosts.
FLAGS = ("-O3", "-march=native", "-mno-avx512f", "-std=c++17", "-shared", "-fPIC")

_state: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("JAXINFER_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "jaxinfer" / "kernels"


def build() -> Path:
    """Compile the kernel (or find it in the cache) -> path of the shared library.
    Raises RuntimeError naming what failed."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler {cxx!r} on PATH (set $CXX)")
    src = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([src, jax.__version__.encode(), cxx.encode(),
                                     " ".join(FLAGS).encode(), platform.machine().encode(),
                                     _cpu_flags().encode()])).hexdigest()[:20]
    out = _cache_dir() / f"int8_matmul-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a private name, then rename: concurrent processes (test workers) each
    # build and the last rename wins; a reader never sees a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed ({' '.join(cmd)}):\n"
                               f"{proc.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def available() -> bool:
    """True once the kernel is built, loaded and registered with XLA:CPU (done once)."""
    if "ok" not in _state:
        try:
            lib = ctypes.cdll.LoadLibrary(str(build()))
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxinferInt8Matmul),
                                        platform="cpu")
            _state.update(ok=True, lib=lib)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            _state.update(ok=False, reason=str(e))
            log.warning("CPU int8 matmul kernel unavailable, using XLA's path: %s", e)
    return bool(_state["ok"])


def unavailable_reason() -> str | None:
    return None if available() else str(_state["reason"])


PANEL = 32   # columns per panel of the packed layout
BLOCK = 64   # K per activation scale in the packed path (K must be a multiple)


def pack(w: QuantizedWeight) -> QuantizedWeight:
    """An int8 weight in the kernel's packed layout, q int8 [N/32, K/2, 32, 2]: panels of
    32 columns, rows in adjacent pairs (the packed path: int16 activations, exact int32
    block sums; see cpu/int8_matmul.cc). Weights with K % 64 or N % 32 stay plain [K, N]
    (the kernel's f32 path)."""
    if w.bits != 8:
        raise ValueError(f"pack: the CPU kernel takes int8 weights, got {w.bits}-bit")
    K, N = w.shape
    if w.panel or K % BLOCK or N % PANEL:
        return w
    q = w.q.reshape(K // 2, 2, N // PANEL, PANEL).transpose(2, 0, 3, 1)
    return QuantizedWeight(q, w.scales, 8, 0, PANEL)


@functools.partial(jax.jit, inline=True)
def int8_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [M, K] @ w (int8, plain or packed) -> [M, N] in x's dtype, f32 math.
    Call ``available()`` first: it registers the kernel."""
    if not isinstance(w, QuantizedWeight) or w.bits != 8:
        raise ValueError("int8_matmul: w must be an int8 QuantizedWeight")
    K, N = w.shape
    if x.ndim != 2 or x.shape[1] != K:
        raise ValueError(f"x: expected [M, K={K}], got shape {x.shape}")
    y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], N), jnp.float32))(
        x.astype(jnp.float32), w.q, w.scales.astype(jnp.float32))
    return y.astype(x.dtype)

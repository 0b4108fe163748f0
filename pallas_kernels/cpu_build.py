"""Building and registering the C++ CPU kernels (pallas_kernels/<op>/*.cc) with XLA:CPU.

Each kernel is one C++ file against the XLA FFI headers that jaxlib ships, compiled on
first use with the host's C++ compiler (``$CXX``, default ``g++``; x86-64 with AVX2 and
FMA) and cached under ``$JAXINFER_KERNEL_CACHE`` (default ``~/.cache/jaxinfer/kernels``)
by a hash of the source (and the shared headers, work_share.h), the jax version, the compiler, the flags and the CPU's flags.
Without a compiler (or on another CPU) loading fails with the reason, and the caller keeps
XLA's path.

A cached library is code this process will run, so the cache is the user's own: its
directory is created 0700 and must be owned by the user and writable by nobody else, and a
library is loaded only if the user owns it and nobody else can write it. A library that
fails the check is rebuilt over; a directory that fails it makes the kernel unavailable.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Sequence

import jax

log = logging.getLogger("jaxinfer")

# -mno-avx512f: each kernel's one code path is AVX2 + FMA (tested), even on AVX-512 hosts.
FLAGS = ("-O3", "-march=native", "-mno-avx512f", "-std=c++17", "-shared", "-fPIC")
PACKAGE_DIR = Path(__file__).parent        # each op's folder holds its .cc; shared headers here
# Built first, at normal priority: the sampler, the first thing a start compiles, calls it.
ROW_SUM = "row_sum/row_sum.cc"
# A caller that has waited this long for a low-priority background build builds it itself:
# waiting leaves its core to the build, and the largest takes ~8 CPU-s (Zen 3), so on a
# machine with nothing else to run it is done by then.
STARVED_AFTER_S = 10.0


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    root = os.environ.get("JAXINFER_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "jaxinfer" / "kernels"


def _untrusted(path: Path, st: os.stat_result) -> str | None:
    """Why ``path`` (stat ``st``) may hold someone else's code, or None if only we can write it."""
    if st.st_uid != os.getuid():
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _private_dir(path: Path) -> Path:
    """Create ``path`` 0700 if missing; raise RuntimeError unless only this user can write it."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"kernel cache {path} is not a directory")
    why = _untrusted(path, st)
    if why:
        raise RuntimeError(f"refusing the kernel cache: {why}")
    return path


def _trusted_library(path: Path) -> bool:
    """True if ``path`` is a regular file only this user can write; False if missing; a file
    someone else could have written is logged and reported untrusted (False: rebuild it)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    why = "it is not a regular file" if not stat.S_ISREG(st.st_mode) else _untrusted(path, st)
    if why:
        log.warning("not loading the cached kernel %s (%s): rebuilding it", path, why)
        return False
    return True


_pending: dict[Path, concurrent.futures.Future] = {}
_pending_lock = threading.Lock()


def build_all_in_background(first: Sequence[str] = (), low_priority: bool = False) -> None:
    """Start compiling every kernel here (<op>/*.cc) in threads: a first start then builds
    them while it compiles the sampler and loads the model, instead of one after another as
    each is first used (each takes seconds). ``build`` waits for them. The row sums at
    once (the sampler, compiled first, waits for them), then ``first`` (sources by their
    path here, in the order the caller will need them: the load lays weights out for a
    matmul kernel), then the rest, largest first, one compiler per core.

    ``low_priority`` (an engine's start): all but the row sums at the lowest priority
    (``_build``) on all cores but one (left to the start's own compile, then its load).
    Why not side by side at normal priority: the builds slowed the sampler's compile by
    half, and then the single-threaded load left a core idle; two low-priority builds
    shared what the compile left over, so the matmul kernel the load waits for came ~3 s
    later (2-core Zen 3, benchmarks/RESULTS.md "Kernel builds behind the sampler")."""
    sources = sorted(PACKAGE_DIR.glob("*/*.cc"))
    unknown = {ROW_SUM, *first} - {_name(s) for s in sources}
    if unknown:       # a renamed kernel would otherwise just lose its place in the order
        raise ValueError(f"build_all_in_background: no kernel source {sorted(unknown)} in {PACKAGE_DIR}")
    with _pending_lock:
        todo = [s for s in sources if s not in _pending]
        if not todo:
            return
        rank = {name: i for i, name in enumerate(first)}
        todo.sort(key=lambda s: (rank.get(_name(s), len(rank)), -s.stat().st_size))
        cores = os.cpu_count() or 1
        rest = concurrent.futures.ThreadPoolExecutor(max(1, cores - 1) if low_priority else cores,
                                                     thread_name_prefix="jaxinfer-kernel-build")
        now = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-kernel-build")
        for src in todo:
            row_sum = _name(src) == ROW_SUM
            _pending[src] = (now if row_sum else rest).submit(_build, src, background=low_priority and not row_sum)
        for pool in (now, rest):
            pool.shutdown(wait=False)


def _name(source: Path) -> str:
    return source.relative_to(PACKAGE_DIR).as_posix()


def build(source: Path) -> Path:
    """Compile ``source`` (or find it in the cache) -> path of the shared library.
    Raises RuntimeError naming what failed."""
    with _pending_lock:
        fut = _pending.pop(source, None)      # once: later calls see the cache (or a new one)
    if fut is None:
        return _build(source)
    try:
        return fut.result(timeout=STARVED_AFTER_S)
    except concurrent.futures.TimeoutError:
        # Something else holds the CPU and the low-priority build barely runs: build it
        # again at our own priority (the first may still finish; the last rename wins).
        log.warning("the background build of %s is starved of CPU; building it now", source.name)
        return _build(source)


def _build(source: Path, background: bool = False) -> Path:
    """``background``: at the lowest CPU priority (``nice -n 19``; why: an engine's start,
    build_all_in_background); ``build`` rebuilds at normal priority if one is starved."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler {cxx!r} on PATH (set $CXX)")
    # the source and every header it may include: beside it and the shared ones here
    headers = sorted(source.parent.glob("*.h")) + sorted(PACKAGE_DIR.glob("*.h"))
    src = b"\0".join([source.read_bytes()] + [h.read_bytes() for h in dict.fromkeys(headers)])
    key = hashlib.sha256(b"\0".join([src, jax.__version__.encode(), cxx.encode(),
                                     " ".join(FLAGS).encode(), platform.machine().encode(),
                                     _cpu_flags().encode()])).hexdigest()[:20]
    out = _private_dir(cache_dir()) / f"{source.stem}-{key}.so"
    if _trusted_library(out):
        return out
    # Compile to a private name, then rename: concurrent processes (test workers) each
    # build and the last rename wins; a reader never sees a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), "-I", str(PACKAGE_DIR), str(source), "-o", tmp]
    if background and shutil.which("nice"):
        cmd = ["nice", "-n", "19", *cmd]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {source.name} failed ({' '.join(cmd)}):\n"
                               f"{proc.stderr[-2000:]}")
        os.chmod(tmp, 0o700)           # the linker's mode follows the umask (0775 under 002)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


class Kernel:
    """One C++ source and the FFI targets it defines ({target name: exported symbol}),
    built, loaded and registered once, on the first ``available()``."""

    def __init__(self, source: str | Path, targets: dict[str, str], what: str):
        self.source = PACKAGE_DIR / source
        self.targets = targets
        self.what = what                 # for the log line: "int8 matmul"
        self._ok: bool | None = None
        self._reason = ""
        self._lib = None

    def available(self) -> bool:
        if self._ok is None:
            try:
                self._lib = ctypes.cdll.LoadLibrary(str(build(self.source)))
                for target, symbol in self.targets.items():
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(self._lib, symbol)),
                                                platform="cpu")
                self._ok = True
            except (RuntimeError, OSError, AttributeError, subprocess.SubprocessError) as e:
                self._ok, self._reason = False, str(e)
                log.warning("CPU %s kernel unavailable, using XLA's path: %s", self.what, e)
        return self._ok

    def unavailable_reason(self) -> str | None:
        return None if self.available() else self._reason

    def build(self) -> Path:
        """Compile the kernel (or find it in the cache) -> path of the shared library.
        Raises RuntimeError naming what failed."""
        return build(self.source)

    def reset(self) -> None:
        """Forget the outcome (tests: retry after changing $CXX or the cache)."""
        self._ok, self._reason, self._lib = None, "", None
        with _pending_lock:
            _pending.pop(self.source, None)

"""Host memory at start-up: what RAM is available, and handing freed memory back.

Why ``malloc_trim``: loading dequantizes every weight into numpy arrays of ~1-2 MB, and
after glibc has freed one mmapped block of a size it serves later blocks of that size
from its heap, which it does not return to the system when they are freed; the float
copies of a loaded model then stay in the process's RSS after the model has moved on
(measured in benchmarks/RESULTS.md, "Start-up").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from typing import Any


def available_ram() -> int | None:
    """Bytes of RAM the system can give without swapping (MemAvailable), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def total_ram() -> int:
    """Bytes of physical RAM of this machine (fixed: unlike available_ram, it does not move
    with what other processes hold)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _glibc(function: str) -> Any:
    """A glibc function, or None (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), function) if name else None
    except (OSError, AttributeError):
        return None


def release_host_memory() -> None:
    """Collect garbage, return the C heap's free memory to the system (glibc only) and
    unmap code pages nothing runs any more (``release_code_pages``)."""
    gc.collect()
    trim_heap()
    release_code_pages()


def trim_heap() -> None:
    """Return the C heap's free pages to the system (glibc ``malloc_trim(0)``; a no-op
    elsewhere), without a garbage collection: cheap enough (a few ms) to call after each
    bucket compile. Why: XLA compiles in several threads, each with its own malloc arena,
    and the compiler's freed scratch stays in those arenas' RSS (measured on the default
    model, 32 sequences, every bucket compiled with an empty XLA cache: 150-230 MiB free
    in the arenas; with a trim after each compile the RSS once all had compiled went
    1,177 -> 1,058 MiB, the peak after the 32-prompt workload 1,994 -> 1,888 MiB; loading
    executables from the persistent cache leaves little free: ~25 MiB)."""
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(0)


_MADV_DONTNEED = 4            # Linux madvise advice


def release_code_pages() -> int:
    """Unmap the resident pages of this process's file-backed machine code (every ``r-xp``
    mapping of a file: the shared libraries' text) and return how many bytes were mapped;
    a no-op (0) where /proc or madvise is missing. The pages stay in the page cache, so
    code still in use faults straight back in (minor faults, no disk read): what stays
    resident is the code the process runs from now on. Why: jaxlib's library is ~0.1 GB
    of text, of which a compile pages in the XLA compiler's (and an import, a load, the
    kernels' builds their own), and nothing hands those pages back while the process
    lives; after the start (and after each background compile) the steps need ~30 MiB of
    it (default model, int8, every shape compiled and the workload served: RSS 604 ->
    515 MiB; RESULTS.md "int8 KV pages by default"). Only clean text is dropped: a
    mapping with a private written copy (``Anonymous`` > 0, e.g. text relocations) is
    skipped, as is anonymous code (XLA's compiled steps)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with open("/proc/self/smaps") as f:
            smaps = f.read()
    except (OSError, AttributeError):
        return 0
    released = 0
    span: tuple[int, int] | None = None
    for line in smaps.splitlines():
        head = line.split(None, 5)
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
            span = None
            if head[1] == "r-xp" and len(head) == 6 and head[5].startswith("/") and head[4] != "0":
                lo, _, hi = head[0].partition("-")
                span = (int(lo, 16), int(hi, 16))
        elif span is not None and line.startswith("Anonymous:"):
            if line.split()[1] == "0" and madvise(span[0], span[1] - span[0], _MADV_DONTNEED) == 0:
                released += span[1] - span[0]
            span = None
    return released


_M_MMAP_THRESHOLD = -3        # glibc's mallopt parameter


def map_large_blocks(threshold: int = 1 << 20) -> None:
    """From now on every allocation of ``threshold`` bytes or more gets a mapping of its
    own, handed back to the system when freed (glibc; a no-op elsewhere, or when the user
    set ``MALLOC_MMAP_THRESHOLD_``, which glibc honours instead). For the life of the
    process: it loads a model and serves it. Why: glibc raises its mmap threshold to the
    size of each mapped block freed (up to 32 MiB), and from then on keeps such blocks in
    its heaps when they are freed. While a model loads, the freed float copies became heap
    holes that the next, larger arrays did not fit (default model, load and repack: peak
    1,290 -> 1,069 MiB); while it serves, each step's and sampler's scratch buffers (up to
    ~14 MiB) stayed resident in the step threads' heaps (int8 server, warm start, the
    32-request workload: peak 698-713 -> 655 MiB, step times unchanged within noise;
    RESULTS.md "The KV pool stacked")."""
    mallopt = _glibc("mallopt")
    if mallopt is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        mallopt(_M_MMAP_THRESHOLD, threshold)


def rss_bytes() -> tuple[int, int] | None:
    """(current, peak) resident set size of this process (Linux), for logs and benchmarks."""
    try:
        with open("/proc/self/status") as f:
            vals = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                    if k in ("VmRSS", "VmHWM")}
        return vals["VmRSS"], vals["VmHWM"]
    except (OSError, KeyError, ValueError):
        return None

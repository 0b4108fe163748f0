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


def release_host_memory() -> None:
    """Collect garbage and return the C heap's free memory to the system (glibc only)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):    # not glibc (musl, macOS)
        return
    trim(0)


def rss_bytes() -> tuple[int, int] | None:
    """(current, peak) resident set size of this process (Linux), for logs and benchmarks."""
    try:
        with open("/proc/self/status") as f:
            vals = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                    if k in ("VmRSS", "VmHWM")}
        return vals["VmRSS"], vals["VmHWM"]
    except (OSError, KeyError, ValueError):
        return None

"""Host memory (jaxinfer/host_memory.py): the C heap's free pages go back to the system,
code pages nothing runs any more are unmapped, and the warm-up hands back the compiler's
scratch and code after every bucket (engine/warmup.py)."""

from __future__ import annotations

import os

import pytest

from jaxinfer import host_memory as memory
from jaxinfer.engine import warmup
from jaxinfer.engine.batch import BucketLadders

# Linux with glibc (CI's machines): malloc_trim exists and /proc/self/status gives the RSS
_GLIBC_LINUX = memory._glibc("malloc_trim") is not None and os.path.exists("/proc/self/status")


def _rss_mib() -> float:
    return memory.rss_bytes()[0] / 2**20


@pytest.mark.skipif(not _GLIBC_LINUX, reason="needs glibc's malloc_trim and /proc/self/status (Linux)")
def test_trim_heap_returns_free_pages_inside_the_heap():
    # 160 MiB of 64 KiB blocks (below glibc's mmap threshold: heap memory), written so the
    # pages are resident; every 8th stays alive, so the freed space is holes inside the
    # heap, which free() alone does not hand back (only a free top of the heap).
    blocks = [b"x" * (64 << 10) for _ in range(2560)]
    kept = blocks[::8]
    del blocks
    before = _rss_mib()
    memory.trim_heap()
    after = _rss_mib()
    assert before - after > 80, (before, after)
    assert len(kept) == 320


class _FakeRunner:
    def __init__(self) -> None:
        self.compiled: set = set()

    def is_compiled(self, b) -> bool:
        return b in self.compiled

    def compile_bucket(self, b) -> None:
        self.compiled.add(b)


def _text_rss_mib() -> float:
    """Resident MiB of this process's file-backed r-xp mappings (libraries' code)."""
    total, text = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                text = head[1] == "r-xp" and len(head) == 6 and head[5].startswith("/")
            elif text and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps (Linux)")
def test_release_code_pages_unmaps_library_code_and_everything_still_runs():
    import jax
    import jax.numpy as jnp
    import numpy as np

    f = jax.jit(lambda x: jnp.cumsum(x * 2.0))
    x = jnp.arange(8, dtype=jnp.float32)
    want = np.asarray(f(x))
    before = _text_rss_mib()
    released = memory.release_code_pages()
    after = _text_rss_mib()
    # jaxlib's text alone is ~0.1 GB mapped, tens of MiB of it resident after a compile
    assert released > 50 << 20, released
    assert after < before - 10, (before, after)
    # the code faults back in where it runs: a compiled function, a new compile, numpy
    np.testing.assert_array_equal(np.asarray(f(x)), want)
    g = jax.jit(lambda x: jnp.sort(-x))
    np.testing.assert_array_equal(np.asarray(g(x)), -np.arange(8, dtype=np.float32)[::-1])
    assert float(np.linalg.norm(np.ones(4))) == 2.0


def test_warmup_trims_the_heap_after_every_compile(monkeypatch):
    calls: list[int] = []
    released: list[int] = []
    runner = _FakeRunner()
    monkeypatch.setattr(warmup, "trim_heap", lambda: calls.append(len(runner.compiled)))
    monkeypatch.setattr(warmup, "release_code_pages", lambda: released.append(len(runner.compiled)))
    lad = BucketLadders((1, 4), (0, 4), ((1, 16), (4, 16)), (13,))
    c = warmup.BucketCompiler([runner], lad)
    c.compile_first()
    c.compile_rest()
    n = len(lad.all_buckets())
    assert c.is_warm and len(runner.compiled) == n
    # the heap: once per bucket, right after it compiled; code pages: after the first
    # buckets and once warm (a blocking warm-up), or after every bucket while it serves
    assert calls == list(range(1, n + 1))
    first = len(warmup.priority_order(lad)[0])
    assert released == [first, n]
    calls.clear(), released.clear()
    runner.compiled.clear()
    c = warmup.BucketCompiler([runner], lad)
    c.compile_first()
    c.start()
    assert c.wait(10)
    assert calls == list(range(1, n + 1))
    assert released == [first] + list(range(first + 1, n + 1)) + [n]

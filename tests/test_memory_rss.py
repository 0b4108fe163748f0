"""Host memory (engine/memory.py): the C heap's free pages go back to the system, and the
warm-up hands back the compiler's scratch after every bucket (engine/warmup.py)."""

from __future__ import annotations

import os

import pytest

from jaxinfer.engine import memory, warmup
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


def test_warmup_trims_the_heap_after_every_compile(monkeypatch):
    calls: list[int] = []
    runner = _FakeRunner()
    monkeypatch.setattr(warmup, "trim_heap", lambda: calls.append(len(runner.compiled)))
    lad = BucketLadders((1, 4), (0, 4), ((1, 16), (4, 16)), (13,))
    c = warmup.BucketCompiler([runner], lad)
    c.compile_first()
    c.compile_rest()
    n = len(lad.all_buckets())
    assert c.is_warm and len(runner.compiled) == n
    # once per bucket, right after it compiled
    assert calls == list(range(1, n + 1))

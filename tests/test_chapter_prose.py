"""The chapters as a learner reads them: one chain of Next links, and no exercise answered before it is asked.

The chapters print engine source with `inspect.getsource(...)`; where that source is an exercise's answer
(the body of a function in `chapters/solutions/`), the learner must not see it before the exercise. Each
`getsource` argument is evaluated here against the chapter's own imports, so what is checked is the source
the chapter's output would show.
"""

import ast
import inspect
import re
import textwrap
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py"))
SOLUTIONS = sorted((ROOT / "chapters" / "solutions").glob("ch[0-9][0-9]_*.py"))
EXERCISE = re.compile(r"^## Exercise", re.M)


def notebook(py: Path):
    return jupytext.reads(py.read_text(encoding="utf-8"), fmt="py:percent")


def code_lines(source: str) -> list[str]:
    """Lines of code without indentation, comments or blank lines: what two copies of a body share."""
    out = []
    for line in source.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def solution_bodies() -> list[tuple[int, str, list[str]]]:
    """(chapter, function name, body lines) for every function in the reference solutions."""
    bodies = []
    for path in SOLUTIONS:
        chapter = int(path.name[2:4])
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef):
                body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(
                    getattr(node.body[0], "value", None), ast.Constant) else node.body
                lines = code_lines("\n".join(ast.get_source_segment(text, stmt, padded=True) for stmt in body))
                bodies.append((chapter, node.name, lines))
    return bodies


def printed_sources(py: Path) -> list[tuple[int, str, str]]:
    """(cell index, expression, its source) for every `inspect.getsource(expr)` in the chapter's code."""
    nb = notebook(py)
    namespace: dict = {}
    for cell in nb.cells[2:] if len(nb.cells) > 2 else []:  # after the title and the Colab setup cell
        if cell.cell_type != "code":
            continue
        for node in ast.parse(cell.source).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                try:
                    exec(compile(ast.Module([node], []), py.name, "exec"), namespace)  # noqa: S102 (the chapter's own imports)
                except ModuleNotFoundError as e:  # a helper the chapter puts on sys.path itself (data/corpus.py)
                    if (e.name or "").startswith("minivllm"):
                        raise
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "inspect.getsource":
                expr = ast.unparse(node.args[0])
                found.append((i, expr, inspect.getsource(eval(expr, namespace))))  # noqa: S307
    return found


def test_the_solutions_have_bodies_to_look_for():
    bodies = solution_bodies()
    assert {c for c, _, _ in bodies} == {int(p.name[2:4]) for p in SOLUTIONS}
    assert all(len(lines) >= 3 for _, _, lines in bodies)


def test_the_check_finds_an_answer_in_printed_source():
    """The matcher itself: the engine's hash_block is chapter 06's answer, BlockPool.allocate chapter 03's."""
    from minivllm.core.block_hash import hash_block
    from minivllm.core.block_pool import BlockPool

    found = {(c, name) for c, name, lines in solution_bodies() for src in (hash_block, BlockPool.allocate)
             if answers(lines, inspect.getsource(src))}
    assert found == {(6, "my_hash_block"), (3, "allocate")}


def answers(body: list[str], source: str) -> bool:
    """Does printed `source` show this solution body: at least 80% of its lines, in a function of its own?"""
    shown = set(code_lines(textwrap.dedent(source)))
    return sum(line in shown for line in body) >= 0.8 * len(body)


@pytest.mark.parametrize("py", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_no_chapter_shows_an_exercise_answer_before_the_exercise(py):
    chapter = int(py.name[:2])
    cells = notebook(py).cells
    exercise_at = next((i for i, c in enumerate(cells) if c.cell_type == "markdown" and EXERCISE.search(c.source)),
                       len(cells))
    for i, expr, source in printed_sources(py):
        for sol_chapter, name, body in solution_bodies():
            if answers(body, source):
                assert sol_chapter < chapter or (sol_chapter == chapter and i > exercise_at), (
                    f"{py.name} prints {expr} (the answer to chapter {sol_chapter:02d}'s `{name}`) in cell {i}, "
                    f"before that exercise")


def test_next_links_chain_through_every_chapter_after_its_exercise():
    for i, py in enumerate(CHAPTERS):
        cells = notebook(py).cells
        links = [(j, m) for j, c in enumerate(cells) if c.cell_type == "markdown"
                 for m in re.findall(r"Next: \[[^\]]+\]\(([^)]+)\)", c.source)]
        if i + 1 == len(CHAPTERS):
            assert links == [], f"{py.name} is the last chapter"
            continue
        assert [m for _, m in links] == [CHAPTERS[i + 1].stem + ".ipynb"], f"{py.name}: one Next link, to the next"
        assert links[0][0] == len(cells) - 1, f"{py.name}: the Next link is the last cell, after the exercise"


@pytest.mark.parametrize("py", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_no_chapter_cites_a_document_the_learner_does_not_have(py):
    text = py.read_text(encoding="utf-8")
    for phrase in ("the material", "the lecture", "source material", "another article", "lecture's"):
        assert phrase not in text.lower(), f"{py.name} refers to {phrase!r}: name the source, with a link"

"""House rules on the shape of the code, read with `ast` (nothing is imported): no function of `mtrain/` outside
`mtrain/bench/` is over 100 lines, and `Trainer.run` is at most 60, so that it reads as the outline of training
(issue #49). A function's length counts its `def` line through its last line, docstring included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mtrain"
MAX_LINES = 100
MAX_RUN_LINES = 60


def functions(path: Path):
    """(qualified name, lines) of every function and method in the file at `path`, nested ones included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

    def walk(node, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                yield name, child.end_lineno - child.lineno + 1
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def test_no_function_over_100_lines():
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if "bench" not in p.relative_to(PACKAGE).parts[:1]]
    assert files
    long = [f"{path.relative_to(ROOT)}:{name}:{lines}" for path in files for name, lines in functions(path)
            if lines > MAX_LINES]
    assert not long, f"functions over {MAX_LINES} lines (file:function:length): " + ", ".join(long)


def test_trainer_run_is_an_outline():
    path = PACKAGE / "train" / "trainer.py"
    lengths = dict(functions(path))
    assert "Trainer.run" in lengths
    assert lengths["Trainer.run"] <= MAX_RUN_LINES, (
        f"{path.relative_to(ROOT)}:Trainer.run:{lengths['Trainer.run']} is over {MAX_RUN_LINES} lines: move a piece "
        "of the step into its own method")

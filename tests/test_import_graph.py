"""The import graph of `mtrain/`, read with `ast` (nothing is imported): no import circles beyond a documented list.

Two graphs are built. The module-level one (the imports a module runs when it is imported) must have no circle at
all. The full one also holds the imports inside functions: they run when the function is called, so a circle
through them is still two modules that each need the other, and the circles the codebase had were of that kind.
Its circles must each lie inside one group of KNOWN_CYCLES, so a new circle fails here; a group that no longer
forms a circle is fine (remove it from the list when its rewrite lands).

No module of a lower layer of the attention stack imports one of a higher layer (ops < parallel < models <
train / eval / bench, `LAYERS`), through the full graph.

Imports under `if TYPE_CHECKING:` are not edges. An import of a package's name (`from mtrain.eval import plots`)
is an edge to the submodule when one of that name exists, else to the package's `__init__`.

No private name crosses a module boundary: no module of `mtrain/` imports a name that starts with an underscore
from another one (`from mtrain.x import _name`), nor reads one through an imported module (`x._name`,
`mtrain.x._name`); a name used by other modules has a public name. Dunder names are not private. The rule is on
names, and on modules with one exception: the Triton kernel modules of `mtrain.ops` (`mtrain/ops/_triton_*.py`)
may be imported from anywhere, as modules and for their public names; their underscore says they import Triton
at their top (so callers import them where Triton runs), not that they are private. No other underscore module
may be imported from outside itself.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mtrain"

# Circles still in the code, each a group of modules that import one another. New ones fail the test.
KNOWN_CYCLES = (
    # plugin registration: the registry imports its task modules so they register; they import the registry
    frozenset({"mtrain.eval.registry", "mtrain.eval.tasks.haystack", "mtrain.eval.tasks.infbench",
               "mtrain.eval.tasks.niah", "mtrain.eval.tasks.pg19", "mtrain.eval.tasks.ruler"}),
)

# Pairs that once formed circles and must not again (issue #31, items 3 and 4): each the module that reads a format,
# setting or function, and the one that used to hold it.
BROKEN_CYCLES = (
    ("mtrain.eval.runner", "mtrain.eval.scoring"),  # the predictions file format: mtrain.eval.predictions
    ("mtrain.tiny", "mtrain.data.synthetic"),  # the tiny tokenizer builder: mtrain.data.tiny_tokenizer
    ("mtrain.config", "mtrain.cli"),  # the offline settings: mtrain.offline
    # the partial-attention autograd function and its packing helpers: mtrain.ops.partial_autograd
    ("mtrain.ops.dense", "mtrain.ops.attention"),
    ("mtrain.ops.fa4", "mtrain.ops.attention"),
    # the per-call context and the layer records: mtrain.models.context (the kinds are plugins of
    # mtrain.models.registry)
    ("mtrain.models.baselines", "mtrain.models.attention"),
)


def module_files() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        out[".".join(parts)] = (path, is_package)
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(node: ast.Import | ast.ImportFrom, package: str, modules) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from . import x, from ..data import y
        parts = package.split(".")
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]


def _owner(name: str, modules) -> str | None:
    """The module of `modules` that `name` (a module, or a name inside one) lives in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


@functools.lru_cache(maxsize=2)
def import_graph(module_level_only: bool) -> dict[str, frozenset[str]]:
    modules = module_files()
    graph = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        edges: set[str] = set()

        def visit(nodes):
            for node in nodes:
                if isinstance(node, ast.If) and _is_type_checking(node):
                    visit(node.orelse)
                    continue
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    for target in _imported_names(node, package, modules):
                        owner = _owner(target, modules) if target.split(".")[0] == "mtrain" else None
                        if owner and owner != name:
                            edges.add(owner)
                    continue
                if module_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    continue
                visit(ast.iter_child_nodes(node))

        visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body)
        graph[name] = frozenset(edges)
    return graph


def cycles(graph: dict[str, frozenset[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(frozenset(component))
    return out


def reaches(graph, source: str, target: str) -> bool:
    seen, todo = {source}, [source]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt == target:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def test_graph_sees_the_package():
    graph = import_graph(False)
    assert {"mtrain.cli", "mtrain.config", "mtrain.eval.runner", "mtrain.eval.predictions", "mtrain.offline",
            "mtrain.tiny", "mtrain.data.tiny_tokenizer"} <= set(graph)
    # a function-level import is an edge of the full graph only (runner imports scoring inside run_suite)
    assert "mtrain.eval.scoring" in graph["mtrain.eval.runner"]
    assert "mtrain.eval.scoring" not in import_graph(True)["mtrain.eval.runner"]


def test_no_module_level_cycles():
    found = cycles(import_graph(True))
    assert not found, "import circles among module-level imports:\n" + "\n".join(sorted(map(str, map(sorted, found))))


def test_only_known_cycles():
    new = [sorted(c) for c in cycles(import_graph(False)) if not any(c <= known for known in KNOWN_CYCLES)]
    assert not new, ("import circles not in KNOWN_CYCLES (break them: move what both sides need into a module "
                     "that both import):\n" + "\n".join(map(str, new)))


@pytest.mark.parametrize("a, b", BROKEN_CYCLES)
def test_broken_cycles_stay_broken(a, b):
    graph = import_graph(False)
    assert a in graph and b in graph
    assert not (reaches(graph, a, b) and reaches(graph, b, a)), f"{a} and {b} import each other again"


def test_config_does_not_import_the_command_line():
    graph = import_graph(False)
    assert not reaches(graph, "mtrain.config", "mtrain.cli")
    assert graph["mtrain.offline"] == frozenset()  # a leaf: anything may import it


def test_tiny_imports_no_stage():
    assert import_graph(False)["mtrain.tiny"] == frozenset()


# The layers of the attention stack, lowest first (issue #31): a module imports from its own layer or lower ones.
LAYERS = (("mtrain.ops",), ("mtrain.parallel",), ("mtrain.models",), ("mtrain.train", "mtrain.eval", "mtrain.bench"))


def layer_of(module: str) -> int | None:
    for level, packages in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in packages):
            return level
    return None


def test_no_lower_layer_imports_a_higher_one():
    graph = import_graph(False)
    upward = [f"{a} -> {b}" for a, edges in graph.items() for b in sorted(edges)
              if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) > layer_of(a)]
    assert not upward, "imports from a lower layer (ops < parallel < models < train/eval/bench) to a higher one:\n" + \
        "\n".join(sorted(upward))


def test_cycles_finds_a_planted_circle():
    graph = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset({"a"})}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]


# Underscore modules that any module may import (see the module docstring): the Triton kernel modules of mtrain.ops.
PUBLIC_UNDERSCORE_MODULES = ("mtrain.ops._triton_",)


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _private_part(dotted: str, modules) -> str | None:
    """The first private component of `dotted` (a module, or a name inside one) that its importer may not use,
    as the dotted path up to it; None when it may."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        prefix = ".".join(parts[: i + 1])
        if not _is_private(part):
            continue
        if prefix in modules and prefix.startswith(PUBLIC_UNDERSCORE_MODULES):
            continue
        return prefix
    return None


def private_uses(source: str, name: str, is_package: bool, modules) -> list[tuple[int, str]]:
    """(line, dotted private name) for each private name of another mtrain module that `source` (the text of
    module `name`) imports or reads through an imported module."""
    package = name if is_package else name.rpartition(".")[0]
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the mtrain module it is bound to
    out = []

    def check(line: int, dotted: str) -> None:
        owner = _owner(dotted, modules)
        if owner == name:
            return
        private = _private_part(dotted, modules)
        if private is not None:
            out.append((line, private))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "mtrain":
                    continue
                check(node.lineno, alias.name)
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            if base.split(".")[0] != "mtrain":
                continue
            for alias in node.names:
                target = f"{base}.{alias.name}"
                check(node.lineno, target)
                if target in modules:
                    bound[alias.asname or alias.name] = target
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):  # each link of a chain: the outer ones name the same private part
            continue
        chain, value = [], node
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in bound:
            check(node.lineno, ".".join([bound[value.id], *reversed(chain)]))
    return sorted(set(out))


def test_no_private_names_across_modules():
    modules = module_files()
    found = []
    for name, (path, is_package) in modules.items():
        for line, private in private_uses(path.read_text(encoding="utf-8"), name, is_package, modules):
            found.append(f"{path.relative_to(ROOT)}:{line}: {private}")
    assert not found, ("private names used outside their module (give them a public name):\n" + "\n".join(found))


def test_private_uses_finds_planted_names():
    modules = {"mtrain.a": None, "mtrain.b": None, "mtrain.c": None, "mtrain.pkg": None, "mtrain.pkg._inner": None,
               "mtrain.ops._triton_x": None}
    source = "\n".join([
        "from mtrain.a import _hidden, shown",
        "import mtrain.b as b",
        "from mtrain.pkg import _inner",
        "from mtrain.ops import _triton_x",
        "from mtrain.ops._triton_x import kernel, _helper",
        "from . import _own",
        "def f():",
        "    return b._secret, b.__name__, _triton_x.run, mtrain.a._deep",
        "import mtrain.a",
    ])
    found = private_uses(source, "mtrain.c", False, modules)
    assert found == [(1, "mtrain.a._hidden"), (3, "mtrain.pkg._inner"), (5, "mtrain.ops._triton_x._helper"),
                     (6, "mtrain._own"), (8, "mtrain.a._deep"), (8, "mtrain.b._secret")]
    assert private_uses("from mtrain.c import _mine\nimport mtrain.c\nx = mtrain.c._mine", "mtrain.c", False,
                        modules) == []


"""Every switch that changes the speed or the results of the attention stack is a typed recipe key (issue #49): the
attention, ring and trainer modules read no module-level boolean switch (and the switches travel as immutable
arguments: tests/test_runtime.py), every environment variable `mtrain/` reads
is a documented platform or debugging one (the table in docs/configuration.md), and the switches' keys are saved in
config.yaml and checked at load. The source checks read the code with `ast` (nothing is imported)."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mtrain"
DOC = ROOT / "docs" / "configuration.md"
# The packages of the attention stack and the trainer: no module-level switch is read inside their functions.
STACK = ("models", "ops", "parallel", "train")


def _module_strings(tree: ast.Module) -> dict[str, tuple[str, ...]]:
    """Module-level NAME = "TEXT" or NAME = ("A", "B", ...) constants: name -> the strings."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out[node.targets[0].id] = (value.value,)
            elif isinstance(value, (ast.Tuple, ast.List)) and value.elts and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts):
                out[node.targets[0].id] = tuple(e.value for e in value.elts)
    return out


def _is_environ(node) -> bool:
    """`os.environ` (or a bare `environ`)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def _loop_sources(tree: ast.Module) -> dict[str, list[ast.expr]]:
    """name -> what a `for name in X` (statement or comprehension) iterates over, for every such loop in the file."""
    out: dict[str, list] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
            out.setdefault(node.target.id, []).append(node.iter)
    return out


def environment_names(path: Path) -> tuple[set[str], list[str]]:
    """(variable names the file reads or sets through os.environ / os.getenv, places whose name could not be told)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    strings, loops = _module_strings(tree), _loop_sources(tree)
    names: set[str] = set()
    unknown: list[str] = []
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name

    def resolve(expr, line: int) -> None:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            names.add(expr.value)
        elif isinstance(expr, ast.Name) and expr.id in strings:
            names.update(strings[expr.id])
        elif isinstance(expr, ast.Name) and expr.id in loops and all(
                isinstance(src, ast.Name) and src.id in strings for src in loops[expr.id]):
            for src in loops[expr.id]:
                names.update(strings[src.id])
        else:
            unknown.append(f"{where}:{line}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner, method = node.func.value, node.func.attr
            if _is_environ(owner) and method in ("get", "setdefault", "pop") and node.args:
                resolve(node.args[0], node.lineno)
            elif _is_environ(owner) and method == "update":
                names.update(k.arg for k in node.keywords if k.arg)
                if node.args:
                    unknown.append(f"{where}:{node.lineno}")
            elif isinstance(owner, ast.Name) and owner.id == "os" and method in ("getenv", "putenv") and node.args:
                resolve(node.args[0], node.lineno)
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            resolve(node.slice, node.lineno)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            resolve(node.left, node.lineno)
    return names, unknown


def documented_variables() -> dict[str, str]:
    """name -> kind ("platform" or "debug") of the rows of the environment variables' table in docs/configuration.md."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Environment variables", 1)[1]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            for name in re.findall(r"`([A-Z][A-Z0-9_]*)`", cells[0]):
                rows[name] = cells[2]
    return rows


def test_every_environment_variable_is_documented():
    """`grep -rn environ mtrain` finds only the variables of the table: platform or debugging ones."""
    documented = documented_variables()
    assert documented and set(documented.values()) <= {"platform", "debug"}, documented
    found, unknown = {}, []
    for path in sorted(PACKAGE.rglob("*.py")):
        names, places = environment_names(path)
        unknown += places
        for name in names:
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not unknown, f"environment reads whose variable cannot be told from the code: {unknown}"
    missing = {name: where for name, where in found.items() if name not in documented}
    assert not missing, ("environment variables read by mtrain/ but not in the table of docs/configuration.md "
                         f"(## Environment variables): {missing}; make a switch a recipe key, or document it")
    assert "LOCAL_WORLD_SIZE" in found and "MTRAIN_GRAPH_RING_ESTIMATE" not in found


def test_collector_sees_every_form(tmp_path):
    source = "\n".join([
        "import os",
        "NAME = 'A_VAR'",
        "MANY = ('B_VAR', 'C_VAR')",
        "def f(key):",
        "    os.environ.get('D_VAR')",
        "    os.environ['E_VAR']",
        "    os.getenv(NAME)",
        "    os.environ.setdefault('F_VAR', '1')",
        "    any(v in os.environ for v in MANY)",
        "    os.environ.update(G_VAR='1')",
        "    return os.environ.get(key)",
    ])
    path = tmp_path / "probe.py"
    path.write_text(source)
    names, unknown = environment_names(path)
    assert names == {"A_VAR", "B_VAR", "C_VAR", "D_VAR", "E_VAR", "F_VAR", "G_VAR"}
    assert len(unknown) == 1


def module_switches(tree: ast.Module) -> dict[str, int]:
    """Module-level names bound to a boolean constant, or to an expression that reads the environment: name -> line."""
    out = {}
    for node in tree.body:
        targets, value = ([node.target], node.value) if isinstance(node, ast.AnnAssign) else (
            (node.targets, node.value) if isinstance(node, ast.Assign) else ((), None))
        if value is None:
            continue
        boolean = isinstance(value, ast.Constant) and isinstance(value.value, bool)
        environ = any(_is_environ(n) or (isinstance(n, ast.Attribute) and n.attr == "getenv")
                      for n in ast.walk(value))
        if boolean or environ:
            for target in targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node.lineno
    return out


def switch_reads(source: str, name: str) -> list[str]:
    """`name:function` for each function of the module whose body reads one of its module-level switches, and
    `name:function reads module.ATTR` for each read of another module's (`module_switches`) through an import."""
    tree = ast.parse(source)
    own = module_switches(tree)
    out = []
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        local = {a.arg for a in func.args.args + func.args.kwonlyargs}
        for node in ast.walk(func):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in own \
                    and node.id not in local:
                out.append(f"{name}:{func.name} reads {node.id}")
    return sorted(set(out))


def stack_modules() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts): p
            for package in STACK for p in sorted((PACKAGE / package).rglob("*.py"))}


def test_the_stack_reads_no_module_level_switch():
    """No module of mtrain/models, ops, parallel, train holds a boolean (or environment-read) module-level setting
    that one of its functions reads, or that another module reads through an import: such settings are recipe keys
    (`mtrain.ops.switches`, passed down from the model's runtime)."""
    modules = stack_modules()
    switches = {}
    found = []
    for name, path in modules.items():
        source = path.read_text(encoding="utf-8")
        found += switch_reads(source, name)
        switches.update({(name, attr): line for attr, line in module_switches(ast.parse(source)).items()})
    # reads through an import of the module (`graphed.GRAPH_ESTIMATE`, `from ... import FUSED`)
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bound = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in modules:
                        bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    elif (node.module, alias.name) in switches:
                        found.append(f"{name} imports {node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in modules:
                        bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound \
                    and (bound[node.value.id], node.attr) in switches:
                found.append(f"{name} reads {bound[node.value.id]}.{node.attr}")
    assert not found, ("module-level switches read at call time (make each a recipe key under attention: or "
                       "parallel:, carried in the runtime's mtrain.ops.switches.Switches):\n"
                       + "\n".join(sorted(found)))


def test_switch_check_fails_on_the_old_code():
    """The check above flags the form the switches had before they were recipe keys."""
    old = "\n".join([
        "import os",
        "FUSED = True",
        "GRAPH = os.environ.get('MTRAIN_GRAPH_RING_ESTIMATE') == '1'",
        "LIMIT = 64",
        "def merge(x):",
        "    if FUSED and GRAPH:",
        "        return LIMIT",
    ])
    assert switch_reads(old, "m") == ["m:merge reads FUSED", "m:merge reads GRAPH"]
    assert set(module_switches(ast.parse(old))) == {"FUSED", "GRAPH"}


REMOVED = {"mtrain.ops.graphed": "GRAPH_ESTIMATE", "mtrain.models.policy": "LAGGED_CHOICE",
           "mtrain.parallel.graphed": "GRAPH_RING_ESTIMATE", "mtrain.parallel.estimate": "LIST_FREE_COLUMNS",
           "mtrain.parallel.merge": "FUSED", "mtrain.parallel.ring_gather": "FA4_GATHER_BACKWARD"}


def test_the_former_switches_are_gone():
    modules = stack_modules()
    for name, attr in REMOVED.items():
        assert not re.search(rf"^{attr}\s*=", modules[name].read_text(encoding="utf-8"), re.M), (name, attr)
    for attr in ("STATIC_WIDTH_BYTES", "FA4_GATHER_SINK"):
        assert not any(re.search(rf"^{attr}\s*=", p.read_text(encoding="utf-8"), re.M) for p in modules.values())


def test_every_switch_is_a_recipe_key_with_the_same_default():
    from mtrain.config import AttentionConfig, ParallelConfig
    from mtrain.ops import switches

    fields = [f.name for f in dataclasses.fields(switches.Switches)]
    assert sorted(fields) == sorted(switches.KEYS)
    sections = {"attention": AttentionConfig(), "parallel": ParallelConfig()}
    for name, key in switches.KEYS.items():
        section, field = key.split(".")
        assert hasattr(sections[section], field), key
    assert switches.from_sections(sections["attention"], sections["parallel"]) == switches.Switches()


def test_switch_keys_are_saved_and_reach_the_switches(recipe_file, tmp_path):
    from mtrain.config import load_recipe
    from mtrain.ops import switches

    (tmp_path / "cost.json").write_text('{"source": "test", "estimate": [0.5, 100.0]}')
    overrides = ["attention.graph_estimate=false", "attention.lagged_choice=false", "attention.cost_table=cost.json",
                 "parallel.graph_ring_estimate=true", "parallel.list_free_columns=false",
                 "parallel.static_width_mib=8", "parallel.fused_merge=false", "parallel.gather_backward=triton",
                 "parallel.gather_sink=columns", "parallel.hierarchy=hierarchical", "parallel.node_size=2",
                 "parallel.cp_size=4"]
    r = load_recipe(recipe_file, overrides)
    r.save(tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["attention"]["graph_estimate"] is False and saved["attention"]["lagged_choice"] is False
    assert saved["attention"]["cost_table"] == str(tmp_path / "cost.json")  # a local path: written absolute
    assert {"graph_ring_estimate": True, "list_free_columns": False, "static_width_mib": 8, "fused_merge": False,
            "gather_backward": "triton", "gather_sink": "columns", "hierarchy": "hierarchical",
            "node_size": 2}.items() <= saved["parallel"].items()
    chosen = switches.from_sections(r.attention, r.parallel)
    assert chosen.static_width_bytes == 8 * 2**20 and chosen.graph_ring_estimate and not chosen.fused_merge
    # the defaults are today's behaviour, and saved too
    d = load_recipe(recipe_file)
    d.save(tmp_path / "default.yaml")
    plain = yaml.safe_load((tmp_path / "default.yaml").read_text())
    assert plain["parallel"]["graph_ring_estimate"] is False and plain["parallel"]["hierarchy"] == "auto"
    assert switches.from_sections(d.attention, d.parallel) == switches.Switches()


def test_hierarchy_and_cost_table_are_checked_against_the_recipe(recipe_file, tmp_path):
    from mtrain.config import load_recipe
    from mtrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"parallel\.node_size: 3 ranks per node do not split parallel\.cp_size 4"):
        load_recipe(recipe_file, ["parallel.cp_size=4", "parallel.node_size=3"])
    assert load_recipe(recipe_file, ["parallel.cp_size=4", "parallel.node_size=3", "parallel.hierarchy=flat"])
    with pytest.raises(ConfigError, match=r"parallel\.hierarchy: hierarchical needs a CP group"):
        load_recipe(recipe_file, ["parallel.hierarchy=hierarchical"])
    with pytest.raises(ConfigError, match=r"parallel\.hierarchy: hierarchical needs nodes smaller"):
        load_recipe(recipe_file, ["parallel.cp_size=4", "parallel.node_size=4", "parallel.hierarchy=hierarchical"])
    (tmp_path / "bad.json").write_text('{"estimate": [1, 2, 3]}')
    with pytest.raises(ConfigError, match=r"attention\.cost_table: 'bad.json' is not a cost-table override "
                                          r"\(estimate needs 2 numbers"):
        load_recipe(recipe_file, ["attention.cost_table=bad.json"])


def test_ring_node_size_follows_the_keys(monkeypatch):
    """parallel.hierarchy auto keeps the launcher's LOCAL_WORLD_SIZE (today's behaviour); flat ignores it; node_size
    takes its place; hierarchical refuses a node size that does not split the group."""
    from mtrain.errors import MtrainError
    from mtrain.ops.switches import Switches
    from mtrain.parallel.comm import ring_node_size

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ring_node_size(4) == 2 and ring_node_size(2) is None and ring_node_size(3) is None
    assert ring_node_size(4, switches=Switches(hierarchy="flat")) is None
    four = Switches(node_size=4)
    assert ring_node_size(8, switches=four) == 4 and ring_node_size(4, switches=four) is None
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ring_node_size(4) is None
    with pytest.raises(MtrainError, match="parallel.hierarchy"):
        ring_node_size(4, switches=Switches(hierarchy="hierarchical"))


def test_cost_table_key_wins_over_the_variable(tmp_path, monkeypatch):
    from mtrain.ops import cost
    from mtrain.ops.switches import Switches

    key, env = tmp_path / "key.json", tmp_path / "env.json"
    key.write_text('{"source": "key", "estimate": [0.25, 1.0]}')
    env.write_text('{"source": "env", "estimate": [0.75, 1.0]}')
    monkeypatch.setenv("MTRAIN_COST_TABLE", str(env))
    assert cost.table_for("cpu").estimate == (0.75, 1.0)
    assert cost.table_for("cpu", switches=Switches(cost_table=str(key))).estimate == (0.25, 1.0)

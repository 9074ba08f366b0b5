"""The attention runtime a patched model owns (`mtrain.models.runtime`): two models with different attention settings
in one process keep their own settings, policy state, records and switches, and nothing in the models' modules or the
trainer holds attention state at module level."""

import ast
import dataclasses
import importlib
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from mtrain.attention_settings import PolicySettings
from mtrain.errors import MtrainError
from mtrain.models.registry import attention_runtime
from mtrain.models.runtime import AttentionRuntime, attach_runtime, runtime_of
from mtrain.ops import cost
from mtrain.tiny import tiny_config

REPO = Path(__file__).resolve().parents[1]
SEQ = 256
STEPS = 3
CAPS = {"block_size": 32, "max_vertical": 4, "max_slash": 32}


@pytest.fixture
def estimates_always(monkeypatch):
    """Under "auto" every layer estimates (the cost model's floor said sparse may pay), so the choice, priced on a
    CPU at 256 tokens, sends it dense and sets its dense hold: the state a hold leaves, at a length a CPU trains fast.
    Process-wide, as the cost model is: the two models read the same one."""
    real = cost.worth_estimating
    monkeypatch.setattr(cost, "worth_estimating", lambda **kw: dataclasses.replace(real(**kw), path="sparse"))


def always_runtime():
    """Every layer sparse, no holds (sparse_policy always, dense_hold 0), recall 0.9."""
    return attention_runtime("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy="always", dense_hold_steps=0, recall=0.9, **CAPS)


def auto_runtime():
    """The cost model's choice with 2-step dense holds (sparse_policy auto, dense_hold 2), recall 0.6."""
    return attention_runtime("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy="auto", dense_hold_steps=2, recall=0.6, **CAPS)


class Run:
    """A tiny model with its own runtime and optimizer, trained a step at a time as the trainer does: the runtime's
    step set, forward, backward, update, the step's records drained."""

    def __init__(self, runtime: AttentionRuntime, seed: int):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(), attn_implementation=runtime.name)
        self.model = attach_runtime(model, runtime).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.ids = torch.randint(0, 500, (1, SEQ), generator=torch.Generator().manual_seed(100 + seed))
        self.losses, self.paths = [], []

    def step(self, step: int) -> None:
        rt = runtime_of(self.model)
        rt.inputs.step = step
        loss = self.model(self.ids, labels=self.ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        records = rt.drain()
        self.losses.append(loss.detach().clone())
        self.paths.append([(r.layer, r.path, r.held, r.density is not None) for r in records.layers])


def alone(make, seed: int) -> Run:
    run = Run(make(), seed)
    for step in range(STEPS):
        run.step(step)
    return run


def test_two_models_with_different_settings_keep_their_own_state_and_train_as_alone(estimates_always):
    """Model A (always, no holds) and model B (auto, 2-step holds) trained step by step interleaved in one process:
    each ends with the policy state and records its settings imply, and each one's losses, paths and state equal
    those of the same model trained alone (bit for bit)."""
    a, b = Run(always_runtime(), seed=0), Run(auto_runtime(), seed=1)
    for step in range(STEPS):
        a.step(step)
        b.step(step)
    layers = tiny_config().num_hidden_layers
    rt_a, rt_b = runtime_of(a.model), runtime_of(b.model)
    assert rt_a is not rt_b and rt_a.settings.sparse.recall == 0.9 and rt_b.settings.sparse.recall == 0.6
    # A: every layer sparse every step, estimated; no hold, no lagged statistics
    assert a.paths == [[(i, "sparse", False, True) for i in range(layers)]] * STEPS
    state_a = rt_a.state_dict()
    assert state_a["dense_until"] == state_a["hold_streak"] == state_a["choice_stats"] == []
    # B: estimated and sent dense at step 0, then held dense for dense_hold = 2 steps without estimating
    assert b.paths[0] == [(i, "dense", False, True) for i in range(layers)]
    assert b.paths[1:] == [[(i, "dense", True, False) for i in range(layers)]] * 2
    assert rt_b.policy.dense_until == {i: 0 + 1 + 2 for i in range(layers)}
    assert rt_b.policy.hold_streak == {i: 1 for i in range(layers)} and rt_b.policy.choice_stats
    # each model equals itself trained alone
    for run, make, seed in ((a, always_runtime, 0), (b, auto_runtime, 1)):
        ref = alone(make, seed)
        assert all(torch.equal(x, y) for x, y in zip(run.losses, ref.losses)), (run.losses, ref.losses)
        assert run.paths == ref.paths
        got, want = runtime_of(run.model).state_dict(), runtime_of(ref.model).state_dict()
        assert json.dumps(got) == json.dumps(want)


def test_the_state_dict_is_the_checkpoint_json_and_loads_into_a_fresh_runtime(estimates_always):
    """The policy state goes through JSON (the trainer_state files' "attention") and back into another runtime;
    a state written before the later keys (checked_until, cap_scale, layer_recall) still loads."""
    run = alone(auto_runtime, seed=1)
    saved = json.loads(json.dumps(runtime_of(run.model).state_dict()))
    assert set(saved) == {"dense_until", "hold_streak", "checked_until", "cap_scale", "layer_recall", "choice_stats"}
    fresh = auto_runtime()
    fresh.load_state_dict(saved)
    assert json.loads(json.dumps(fresh.state_dict())) == saved
    old = {key: saved[key] for key in ("dense_until", "hold_streak", "choice_stats")}
    older = auto_runtime()
    older.load_state_dict(old)
    assert older.policy.dense_until == runtime_of(run.model).policy.dense_until and older.policy.cap_scale == {}


def _expensive_dense_table(tmp_path) -> str:
    """A cost-table override (attention.cost_table) under which dense costs 1 s a call at head dim 32: the choice of
    "auto" then runs sparse where the CPU's built-in figures run it dense."""
    path = tmp_path / "dense-expensive.json"
    path.write_text(json.dumps({"source": "test", "dense": {"32": {"train": [1000.0, 0.0], "eval": [1000.0, 0.0]}}}))
    return str(path)


def test_each_models_attention_passes_its_own_switches_down(monkeypatch):
    """Each attention call hands its runtime's switches to the readers below it (here the one-device estimate, which
    reads attention.graph_estimate): models a, b, a in turn, each call with its own model's, nothing put in place."""
    import mtrain.ops.graphed as graphed
    from mtrain.ops.switches import Switches

    seen = []
    real = graphed.estimate_graphed

    def spy(q, k, *, switches=None, **kwargs):
        seen.append(switches)
        return real(q, k, switches=switches, **kwargs)

    monkeypatch.setattr(graphed, "estimate_graphed", spy)
    a, b = always_runtime(), always_runtime()
    a.settings.switches = Switches(lagged_choice=False, graph_estimate=False)
    b.settings.switches = Switches(lagged_choice=True, graph_estimate=True, fused_merge=False)
    ids = torch.randint(0, 500, (1, 128))
    for rt in (a, b, a):
        model = attach_runtime(AutoModelForCausalLM.from_config(tiny_config(), attn_implementation=rt.name), rt)
        with torch.no_grad():
            model(ids)
    layers = tiny_config().num_hidden_layers
    assert seen == [a.switches] * layers + [b.switches] * layers + [a.switches] * layers
    assert a.switches != b.switches


class GradRun(Run):
    """`Run`, keeping every step's gradients too."""

    def __init__(self, runtime: AttentionRuntime, seed: int):
        super().__init__(runtime, seed)
        self.grads = []

    def step(self, step: int) -> None:
        rt = runtime_of(self.model)
        rt.inputs.step = step
        loss = self.model(self.ids, labels=self.ids).loss
        loss.backward()
        self.grads.append([p.grad.detach().clone() for p in self.model.parameters()])
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        records = rt.drain()
        self.losses.append(loss.detach().clone())
        self.paths.append([(r.layer, r.path, r.held, r.density is not None) for r in records.layers])


def test_two_models_with_different_switches_train_interleaved_as_alone(estimates_always, tmp_path):
    """Two models under sparse_policy auto that differ only in their switches, trained step by step interleaved in one
    process: A with a cost table where dense is expensive (attention.cost_table) and attention.lagged_choice off, B
    with the defaults. A's layers run sparse every step and B's go dense and are held there, and each one's losses,
    gradients and paths equal those of the same model trained alone, bit for bit.

    On the CPU no switch changes what a backward computes (parallel.fused_merge and parallel.gather_backward act on
    CUDA, under the fa4 engine), so these two differ in switches that act in the forward; that the backward reads the
    switches of its own forward is checked on the gathered step below
    (`test_the_backward_reads_the_switches_its_forward_ran_with`)."""
    from mtrain.ops.switches import Switches

    table = _expensive_dense_table(tmp_path)

    def make_a():
        rt = auto_runtime()
        rt.settings.switches = Switches(cost_table=table, lagged_choice=False)
        return rt

    def make_b():
        return auto_runtime()  # the default switches

    def alone_run(make, seed):
        run = GradRun(make(), seed)
        for step in range(STEPS):
            run.step(step)
        return run

    a, b = GradRun(make_a(), seed=0), GradRun(make_b(), seed=1)
    for step in range(STEPS):
        a.step(step)
        b.step(step)
    layers = tiny_config().num_hidden_layers
    assert a.paths == [[(i, "sparse", False, True) for i in range(layers)]] * STEPS
    assert b.paths[0] == [(i, "dense", False, True) for i in range(layers)]
    assert b.paths[1:] == [[(i, "dense", True, False) for i in range(layers)]] * (STEPS - 1)
    for run, make, seed in ((a, make_a, 0), (b, make_b, 1)):
        ref = alone_run(make, seed)
        assert all(torch.equal(x, y) for x, y in zip(run.losses, ref.losses)), (run.losses, ref.losses)
        assert all(torch.equal(x, y) for got, want in zip(run.grads, ref.grads) for x, y in zip(got, want))
        assert run.paths == ref.paths


def test_the_backward_reads_the_switches_its_forward_ran_with(monkeypatch):
    """The backward of an attention op runs outside the attention call, after other calls (another model's, another
    layer's) have run: the gathered step (`mtrain.parallel.ring_gather`, one rank of CP 2 run alone on the CPU,
    `emulated_group`) keeps the switches of its forward and its backward reads those (parallel.gather_backward, and
    parallel.fused_merge for the owners' dK/dV sum), whatever ran in between. Two forwards with different switches,
    their backwards in the other order; the gradients are those of the same step run alone."""
    import math

    from emulated import BLOCK, DIM, sample_case

    from mtrain.bench.emulate import emulated_group
    from mtrain.ops.switches import Switches
    from mtrain.parallel import Layout, ring_gather
    from mtrain.parallel.merge import RankParts
    from mtrain.parallel.plan import gathered_sparse_plan

    seen = []
    real_backward, real_sum = ring_gather.gathered_backward, RankParts.sum

    def backward_spy(engine, world, *, switches=None):
        seen.append(("gather_backward", switches.gather_backward))
        return real_backward(engine, world, switches=switches)

    def sum_spy(self, dtype, *, switches=None):
        seen.append(("fused_merge", switches.fused_merge))
        return real_sum(self, dtype, switches=switches)

    monkeypatch.setattr(ring_gather, "gathered_backward", backward_spy)
    monkeypatch.setattr(RankParts, "sum", sum_spy)
    q, k, v, dout, index = sample_case(6)
    layout = Layout.create("block-stripe", world_size=2, granularity=BLOCK)
    scale = 1.0 / math.sqrt(DIM)
    a, b = Switches(gather_backward="triton", fused_merge=False), Switches(gather_backward="fa4", fused_merge=True)

    def forward(switches):
        shards = [layout.shard(t.float(), 0).requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
        plan = gathered_sparse_plan(index, layout, 0, torch.device("cpu"), sink="listed")
        out, _ = ring_gather.ring_gather_attention(*shards[:3], plan, None, scale, switches=switches)
        return out, shards

    with emulated_group(2, 0):
        alone, alone_shards = forward(a)
        alone.backward(alone_shards[3])
        seen.clear()
        out_a, shards_a = forward(a)
        out_b, shards_b = forward(b)
        out_b.backward(shards_b[3])
        out_a.backward(shards_a[3])
    assert seen == [("gather_backward", "fa4"), ("fused_merge", True), ("fused_merge", True),
                    ("gather_backward", "triton"), ("fused_merge", False), ("fused_merge", False)]
    for got in (shards_a, shards_b):
        assert all(torch.equal(x.grad, y.grad) for x, y in zip(got[:3], alone_shards[:3]))


def test_a_model_without_a_runtime_is_refused_naming_the_fix():
    rt = always_runtime()
    model = AutoModelForCausalLM.from_config(tiny_config(), attn_implementation=rt.name)
    with pytest.raises(MtrainError, match="no mtrain attention runtime.*attach_runtime"):
        model(torch.randint(0, 500, (1, 64)))
    with pytest.raises(MtrainError, match="no mtrain attention runtime"):
        runtime_of(SimpleNamespace(layer_idx=0))
    assert runtime_of(attach_runtime(model, rt).model.layers[0].self_attn) is rt


# Module globals of the checked modules that are mutable objects, each with the reason it holds no model's state.
# Anything else assigned at module level must be immutable (str, numbers, tuples, frozen dataclasses, loggers).
ALLOWED = {
    ("mtrain.models", "__all__"): "the package's export list",
    ("mtrain.models.attention", "KINDS"): "constant table: attention.kind -> (sparse?, layout), written at import",
    ("mtrain.models.baselines", "KINDS"): "constant table, as attention.KINDS",
    ("mtrain.models.registry", "KINDS"): "constant table: the plugins' KINDS merged at import",
    ("mtrain.models.registry", "_PLUGIN_OF"): "constant table: kind -> plugin module, built at import",
    ("mtrain.models.loading", "MODEL_FAMILIES"): "constant table: model_type -> ModelFamily",
    ("mtrain.models.loading", "_DTYPES"): "constant table: recipe dtype -> torch dtype name",
    ("mtrain.models.attention", "_ENGINES_SAID"): "log-once memo of the engine choices already logged: no state a "
                                                  "call reads to decide anything",
    ("mtrain.models.attention", "_SHORTEST"): "memo of a pure function (the shortest document that pays, keyed by "
                                              "the cost table and every argument): the same answer for any model",
}
IMMUTABLE = (str, bytes, int, float, bool, type(None), tuple, frozenset)


def _checked_modules():
    paths = sorted((REPO / "mtrain" / "models").glob("*.py")) + [REPO / "mtrain" / "train" / "trainer.py"]
    for path in paths:
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path


def _assigned_names(path: Path) -> set:
    names = set()
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        for target in targets:
            names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def _mutable(value) -> bool:
    import logging

    if isinstance(value, IMMUTABLE + (logging.Logger,)):
        return False
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return not type(value).__dataclass_params__.frozen
    return not isinstance(value, type) and not callable(value)


def test_no_module_level_attention_state_in_the_models_or_the_trainer():
    """mtrain/models/*.py and mtrain/train/trainer.py hold no mutable module global but the allowlisted constant
    tables and memos (a global the attention read as state would be shared by every model of the process), and no
    source of the package or its tools names a process-wide attention context."""
    found = []
    for name, path in _checked_modules():
        module = importlib.import_module(name)
        for attr in sorted(_assigned_names(path)):
            value = getattr(module, attr)
            if _mutable(value) and (name, attr) not in ALLOWED:
                found.append(f"{name}.{attr} ({type(value).__name__})")
    assert not found, f"module-level mutable objects (attention state belongs in the model's runtime): {found}"
    named = [str(p.relative_to(REPO)) for folder in ("mtrain", "tools") for p in sorted((REPO / folder).rglob("*.py"))
             if re.search(r"\bCONTEXT\b", p.read_text())]
    assert not named, f"sources naming a process-wide CONTEXT: {named}"


# The packages whose modules the attention calls and the trainer run: none holds a switch at module level.
STACK = ("models", "ops", "parallel", "train")
# The process-wide switches object the stack read before issue #49, and its helpers that set it.
OLD_SWITCHES = "SWITCHES"
OLD_HELPERS = ("configure", "use", "applied")
# Module globals whose keys are switch names, each with the reason it holds no switch's value.
NAMES_ALLOWED = {
    ("mtrain.ops.switches", "KEYS"): "constant table: Switches field -> its recipe key",
    ("mtrain.ops.switches", "SCALES"): "constant table: Switches field -> the factor from its key's unit",
}


def _stack_modules():
    for package in STACK:
        for path in sorted((REPO / "mtrain" / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def _names_held(value) -> set:
    """The names a module-level object holds values under: a dict's string keys, an instance's attributes."""
    if isinstance(value, dict):
        return {key for key in value if isinstance(key, str)}
    if isinstance(value, type) or callable(value) or not hasattr(value, "__dict__"):
        return set()
    return set(vars(value))


def _switch_state(name: str, module, attrs, fields: set) -> list[str]:
    """The module-level attributes `attrs` of `module` that are state a call could read as a switch (see below)."""
    found = []
    for attr in sorted(attrs):
        value = getattr(module, attr)
        if attr == OLD_SWITCHES:
            found.append(f"{name}.{attr} (the old process-wide switches)")
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            if not type(value).__dataclass_params__.frozen:
                found.append(f"{name}.{attr} (a {type(value).__name__}, a dataclass that is not frozen)")
        elif _names_held(value) & fields and (name, attr) not in NAMES_ALLOWED:
            found.append(f"{name}.{attr} (holds {sorted(_names_held(value) & fields)})")
    return found


def test_the_stack_holds_no_mutable_switch_at_module_level():
    """No module of mtrain/models, ops, parallel or train holds module-level mutable state a call could read as a
    switch: no instance of a dataclass that is not frozen, no object or dict holding values under switch names (but
    the constant tables of NAMES_ALLOWED), and the process-wide SWITCHES and its setters (configure, use, applied) are
    gone; `Switches` itself is immutable, so the documented defaults (`DEFAULTS`) cannot be changed in place either.
    Neither the package nor its tools name the old global or its setters."""
    from mtrain.ops import switches

    fields = {f.name for f in dataclasses.fields(switches.Switches)}
    assert switches.Switches.__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        switches.DEFAULTS.fused_merge = False
    assert switches.DEFAULTS == switches.Switches()
    left = [name for name in (OLD_SWITCHES, *OLD_HELPERS) if hasattr(switches, name)]
    assert not left, f"mtrain.ops.switches still has {left}: switches travel as arguments (the model's runtime's)"
    found = []
    for name, path in _stack_modules():
        found += _switch_state(name, importlib.import_module(name), _assigned_names(path), fields)
    assert not found, ("module-level state read as switches (pass the run's Switches down from the model's runtime, "
                       f"mtrain.ops.switches): {found}")
    named = [str(p.relative_to(REPO)) for folder in ("mtrain", "tools") for p in sorted((REPO / folder).rglob("*.py"))
             if OLD_FORM.search(p.read_text())]
    assert not named, f"sources naming the old process-wide switches or their setters: {named}"


OLD_FORM = re.compile(rf"\b{OLD_SWITCHES}\b|\bswitches\.({'|'.join(OLD_HELPERS)})\(|"
                      rf"from mtrain\.ops\.switches import .*\b({'|'.join(OLD_HELPERS)})\b")


def test_the_switch_check_fails_on_the_old_form():
    """The check above flags what the stack held before issue #49 (a mutable Switches as SWITCHES, swapped by
    `use`), and other forms of it: a mutable dataclass, a namespace or a dict of switch values; a frozen Switches
    and the constant tables pass."""
    import types

    from mtrain.ops import switches

    @dataclasses.dataclass
    class Mutable:
        fused_merge: bool = True

    old = types.ModuleType("old")
    old.SWITCHES, old.FLAGS, old.SPACE = Mutable(), Mutable(), types.SimpleNamespace(graph_estimate=True)
    old.TABLE, old.FROZEN, old.KEYS = {"lagged_choice": False}, switches.Switches(), dict(switches.KEYS)
    fields = {f.name for f in dataclasses.fields(switches.Switches)}
    found = _switch_state("old", old, ["SWITCHES", "FLAGS", "SPACE", "TABLE", "FROZEN", "KEYS"], fields)
    assert [f.split(" ")[0] for f in found] == ["old.FLAGS", "old.KEYS", "old.SPACE", "old.SWITCHES", "old.TABLE"]
    assert not _switch_state("mtrain.ops.switches", switches, ["KEYS", "SCALES", "DEFAULTS"], fields)
    assert OLD_FORM.search("with switches.use(fused_merge=False):") and OLD_FORM.search("SWITCHES.fused_merge")
    assert OLD_FORM.search("from mtrain.ops.switches import applied")
    assert not OLD_FORM.search("from mtrain.ops.switches import Switches, or_defaults")

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
    return attention_runtime("mtraining", sparse_policy="always", dense_hold=0, recall=0.9, **CAPS)


def auto_runtime():
    """The cost model's choice with 2-step dense holds (sparse_policy auto, dense_hold 2), recall 0.6."""
    return attention_runtime("mtraining", sparse_policy="auto", dense_hold=2, recall=0.6, **CAPS)


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


def test_each_models_attention_runs_under_its_own_switches(monkeypatch):
    """Each attention call puts its runtime's switches in place for the call and restores the process's after."""
    import mtrain.models.attention as attention
    from mtrain.ops.switches import SWITCHES, Switches

    seen = []
    real = attention._attention

    def spy(rt, *args, **kwargs):
        seen.append((rt.settings.sparse.recall, SWITCHES.lagged_choice, SWITCHES.graph_estimate))
        return real(rt, *args, **kwargs)

    monkeypatch.setattr(attention, "_attention", spy)
    before = dataclasses.asdict(SWITCHES)
    a, b = always_runtime(), auto_runtime()
    a.settings.switches = Switches(lagged_choice=False, graph_estimate=False)
    b.settings.switches = Switches(lagged_choice=True, graph_estimate=True)
    ids = torch.randint(0, 500, (1, 128))
    for rt in (a, b, a):
        model = attach_runtime(AutoModelForCausalLM.from_config(tiny_config(), attn_implementation=rt.name), rt)
        with torch.no_grad():
            model(ids)
    layers = tiny_config().num_hidden_layers
    assert seen == [(0.9, False, False)] * layers + [(0.6, True, True)] * layers + [(0.9, False, False)] * layers
    assert dataclasses.asdict(SWITCHES) == before


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

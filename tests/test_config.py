"""Recipe loading: typed validation, overrides, clear errors naming the key."""


import pytest
import yaml

from mtrain.config import _read_recipe, load_recipe, parse_recipe
from mtrain.errors import ConfigError
from mtrain.tiny import MODEL_CONFIG as CONFIG
from mtrain.tiny import TOKENIZER_DIR as TOKENIZER


def test_loads_and_applies_overrides(recipe_file):
    r = load_recipe(recipe_file, ["train.max_steps=7", "optim.lr=2e-4", "train.deterministic=true",
                                  "model.rope_scaling.rope_type=yarn", "model.rope_scaling.factor=4",
                                  "model.rope_scaling.original_max_position_embeddings=256"])
    assert r.train.max_steps == 7
    assert r.optim.lr == pytest.approx(2e-4)
    assert r.train.deterministic is True
    assert r.model.rope_scaling == {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 256}
    assert r.parallel.cp_size == 1 and r.attention.kind == "dense"


def test_unknown_key_named_with_suggestion(recipe_file):
    with pytest.raises(ConfigError, match=r"train\.max_step'.*did you mean 'max_steps'"):
        load_recipe(recipe_file, ["train.max_step=3"])
    with pytest.raises(ConfigError, match="bogus_key"):
        load_recipe(recipe_file, ["train.bogus_key=1"])
    with pytest.raises(ConfigError, match="unknown section 'trian'.*'train'"):
        load_recipe(recipe_file, ["trian.max_steps=1"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.max_steps=abc", r"train\.max_steps: expected an integer"),
        ("train.deterministic=3", r"train\.deterministic: expected true or false"),
        ("optim.schedule=cosin", r"optim\.schedule: 'cosin' is not one of .*did you mean 'cosine'"),
        ("attention.kind=mtrainig", r"attention\.kind: 'mtrainig'.*did you mean 'mtraining'"),
        ("data.path=nowhere", r"data\.path: 'nowhere' does not exist"),
        ("model.tokenizer=missing-tok", r"model\.tokenizer: path 'missing-tok' does not exist"),
        ("parallel.cp_size=0", r"parallel\.cp_size: must be positive"),
        ("model.rope_scaling.rope_type=yarn", r"model\.rope_scaling\.factor: required"),
        ("optim.grad_clip=-1", r"optim\.grad_clip: must be >= 0"),
        ("optim.lr=.nan", r"optim\.lr: must be a finite number"),
        ("optim.betas=[0.9, 1.5]", r"optim\.betas: must both be in \[0, 1\)"),
        ("optim.eps=0", r"optim\.eps: must be positive"),
        ("model.rope_theta=-5", r"model\.rope_theta: must be positive"),
        ("train.output_dir=cfg.json", r"train\.output_dir: 'cfg.json' is a file"),
        ("model.config=tok", r"model\.config: 'tok' is not a file"),
        ("attention.engine=cudnn", r"attention\.engine: 'cudnn' is not one of 'auto', 'triton', 'flex', 'fa4'"),
        ("parallel.schedule=allgather", r"parallel\.schedule: 'allgather' is not one of 'ring', 'gather'"),
        ("attention.sample_rows=0", r"attention\.sample_rows: must be a positive integer or null"),
        ("attention.max_output_error=0", r"attention\.max_output_error: must be a number > 0"),
        ("attention.max_output_error=-0.1", r"attention\.max_output_error: must be a number > 0"),
        ("attention.max_output_error=.inf", r"attention\.max_output_error: must be a finite number"),
        ("attention.widen_caps=3", r"attention\.widen_caps: expected true or false, got 3"),
        ("attention.widen_caps=sometimes", r"attention\.widen_caps: expected true or false, got 'sometimes'"),
        ("attention.widen_max_list_mib=-1", r"attention\.widen_max_list_mib: must be an integer >= 0"),
        ("attention.widen_max_list_mib=lots", r"attention\.widen_max_list_mib: expected an integer, got 'lots'"),
        ("attention.escalate_recall=0.99", r"attention\.escalate_recall: must be a number above attention\.recall"),
        ("attention.escalate_recall=1.5", r"attention\.escalate_recall: must be a number above attention\.recall"),
        # the switches (mtrain.ops.switches) and attention.per_document
        ("parallel.graph_ring_estimate=1", r"parallel\.graph_ring_estimate: expected true or false"),
        ("attention.lagged_choice=yes please", r"attention\.lagged_choice: expected true or false"),
        ("parallel.gather_backward=atomic", r"parallel\.gather_backward: 'atomic' is not one of"),
        ("parallel.gather_sink=listed", r"parallel\.gather_sink: 'listed' is not one of"),
        ("parallel.hierarchy=tree", r"parallel\.hierarchy: 'tree' is not one of"),
        ("parallel.static_width_mib=-1", r"parallel\.static_width_mib: must be an integer >= 0"),
        ("parallel.node_size=0", r"parallel\.node_size: must be a positive number"),
        ("attention.cost_table=missing.json", r"attention\.cost_table: 'missing.json' is not a file"),
        ("attention.per_document=sometimes", r"attention\.per_document: expected true or false"),
    ],
)
def test_bad_values_name_the_key(recipe_file, override, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe(recipe_file, [override])


def test_one_device_engines_are_refused_under_context_parallelism(recipe_file):
    assert load_recipe(recipe_file, ["attention.engine=flex"]).attention.engine == "flex"
    with pytest.raises(ConfigError, match=r"attention\.engine: 'flex' runs on one device only.*set attention\.engine: auto"):
        load_recipe(recipe_file, ["attention.engine=flex", "parallel.cp_size=2"])
    # the ring's sparse steps run FA4 (falling back to ours where it cannot run)
    assert load_recipe(recipe_file, ["attention.engine=fa4", "parallel.cp_size=2"]).attention.engine == "fa4"


def test_widen_caps_is_on_by_default_and_reaches_the_registration(recipe_file, monkeypatch):
    from mtrain.models import registry

    assert load_recipe(recipe_file).attention.widen_caps is True
    recipe = load_recipe(recipe_file, ["attention.kind=mtraining", "attention.widen_caps=false"])
    assert recipe.attention.widen_caps is False
    seen = {}
    monkeypatch.setattr(registry, "register_kind", lambda kind, **kw: seen.update(kw["policy"].__dict__) or kind)
    registry.register_attention(recipe)
    assert seen["widen_caps"] is False
    assert seen["widen_max_list_mib"] == 0
    recipe = load_recipe(recipe_file, ["attention.kind=mtraining", "attention.widen_max_list_mib=1024"])
    registry.register_attention(recipe)
    assert seen["widen_max_list_mib"] == 1024
    assert seen["escalate_recall"] == 0.995 and seen["max_output_error"] == 0.025  # the defaults that keep quality
    recipe = load_recipe(recipe_file, ["attention.kind=mtraining", "attention.max_output_error=0.025",
                                       "attention.escalate_recall=0.995"])
    registry.register_attention(recipe)
    assert seen["escalate_recall"] == 0.995 and seen["max_output_error"] == 0.025


def test_quality_check_and_escalation_are_on_by_default(recipe_file):
    """The mtraining kind's defaults hold quality (issue #50): the check at 0.025 and escalation to 0.995, 32 sampled
    blocks. A recipe that turns the check off, or asks for a recall of 0.995 or more, has no default escalation; an
    escalation it names without the check is refused."""
    a = load_recipe(recipe_file).attention
    assert (a.max_output_error, a.escalate_recall, a.sample_blocks) == (0.025, 0.995, 32)
    off = load_recipe(recipe_file, ["attention.max_output_error=null"]).attention
    assert off.max_output_error is None and off.escalate_recall is None
    high = load_recipe(recipe_file, ["attention.recall=0.995"]).attention
    assert high.escalate_recall is None and high.max_output_error == 0.025
    with pytest.raises(ConfigError, match=r"attention\.escalate_recall needs attention\.max_output_error"):
        load_recipe(recipe_file, ["attention.max_output_error=null", "attention.escalate_recall=0.999"])


def test_max_output_error_runs_under_context_parallelism(recipe_file):
    assert load_recipe(recipe_file, ["attention.max_output_error=0.03"]).attention.max_output_error == 0.03
    cp = load_recipe(recipe_file, ["attention.max_output_error=0.03", "parallel.cp_size=2"])
    assert cp.attention.max_output_error == 0.03 and cp.parallel.cp_size == 2


def test_resolved_config_round_trips(recipe_file, tmp_path, monkeypatch):
    """save then load gives the same recipe, local paths written absolute (the same files from any directory)."""
    import os

    from mtrain.config import LOCAL_PATH_KEYS

    monkeypatch.chdir(recipe_file.parent)
    r = load_recipe(recipe_file, ["train.seed=3"])
    assert not os.path.isabs(r.model.config)
    r.save(tmp_path / "resolved.yaml")
    monkeypatch.chdir(tmp_path.parent)
    again = load_recipe(tmp_path / "resolved.yaml")
    for section, key in LOCAL_PATH_KEYS:
        given, saved = getattr(getattr(r, section), key), getattr(getattr(again, section), key)
        if given is not None and (recipe_file.parent / given).exists():  # ("out" does not exist yet: kept as given)
            assert saved == os.path.join(recipe_file.parent, given), (section, key)
            setattr(getattr(again, section), key, given)
    assert again == r


def test_cli_bogus_key_is_one_short_line(recipe_file):
    from ranks import run_cli  # python -m mtrain, forked from the CLI's server

    proc = run_cli("train", str(recipe_file), "--set", "train.bogus_key=1", cwd=recipe_file.parent)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "bogus_key" in lines[0] and "Traceback" not in proc.stderr


def test_shipped_recipes_validate(tmp_path, monkeypatch):
    """Every recipe in recipes/ loads (the data folder and the stage-1 checkpoint pointed at a stand-in)."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)  # as under `mtrain --online`: hub ids pass to transformers
    (tmp_path / "index.json").write_text('{"shards": []}')
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    (tmp_path / "tokenizer.json").write_text("{}")
    recipes = sorted((repo / "recipes").glob("*.yaml"))
    assert len(recipes) >= 5
    for recipe in recipes:
        raw = _read_recipe(recipe)  # with its base recipe's sections (`base:`)
        overrides = [f"data.path={tmp_path}"]
        if (raw["model"].get("path") or "").startswith("runs/"):
            overrides.append(f"model.path={tmp_path}")
        r = load_recipe(recipe, overrides)
        assert r.data.seq_len % max(1, r.parallel.cp_size * r.parallel.granularity) == 0, recipe.name


def test_base_recipe_is_merged_key_by_key(tmp_path):
    """`base: OTHER.yaml` (relative to the recipe): the recipe holds only what differs; a nested mapping
    (model.rope_scaling) replaces the base's whole; a chain of bases resolves; a loop is refused."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "index.json").write_text('{"shards": []}')
    base = {"model": {"config": str(CONFIG), "tokenizer": str(TOKENIZER), "rope_scaling": {"rope_type": "yarn",
            "factor": 4.0, "original_max_position_embeddings": 1024}},
            "data": {"path": str(tmp_path / "data"), "seq_len": 2048},
            "attention": {"kind": "mtraining", "block_size": 32}, "train": {"output_dir": "runs/a", "max_steps": 7}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "twin.yaml").write_text(yaml.safe_dump({"base": "../base.yaml", "attention": {"kind": "dense"},
                                                   "model": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                                                   "train": {"output_dir": "runs/b"}}))
    (sub / "grandchild.yaml").write_text(yaml.safe_dump({"base": "twin.yaml", "train": {"max_steps": 3}}))
    r = load_recipe(sub / "grandchild.yaml", ["train.seed=5"])
    assert (r.attention.kind, r.attention.block_size) == ("dense", 32)
    assert r.model.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert (r.train.output_dir, r.train.max_steps, r.train.seed, r.data.seq_len) == ("runs/b", 3, 5, 2048)
    (tmp_path / "loop.yaml").write_text(yaml.safe_dump({"base": "loop2.yaml"}))
    (tmp_path / "loop2.yaml").write_text(yaml.safe_dump({"base": "loop.yaml"}))
    with pytest.raises(ConfigError, match="leads back to itself"):
        load_recipe(tmp_path / "loop.yaml")
    (tmp_path / "missing.yaml").write_text(yaml.safe_dump({"base": "nope.yaml"}))
    with pytest.raises(ConfigError, match="nope.yaml' does not exist"):
        load_recipe(tmp_path / "missing.yaml")


def test_four_gpu_recipes_are_twins():
    """The 4-GPU pair differs only in attention kind and run folder; both are CP=4 + ZeRO-2 with activation
    checkpointing and YaRN from 8K to 512K; the Qwen2.5-3B one is CP=4 + ZeRO-2 with optimizer offload at 1M."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    sparse, dense = (_read_recipe(repo / "recipes" / f"smollm2-512k-{k}.yaml") for k in ("mtraining", "dense"))
    assert sparse["attention"].pop("kind") == "mtraining" and dense["attention"].pop("kind") == "dense"
    assert sparse["train"].pop("output_dir") != dense["train"].pop("output_dir")
    # the dense side runs as a user would on one node: zigzag shards, the gathered varlen call (dense_gather)
    assert (dense["parallel"].pop("layout"), dense["parallel"].pop("dense_schedule")) == ("zigzag", "gather")
    assert sparse["parallel"].pop("layout") == "block-stripe"
    assert sparse == dense
    assert sparse["parallel"]["cp_size"] == 4 and sparse["train"]["deepspeed"] == "configs/deepspeed/zero2.json"
    assert sparse["model"]["gradient_checkpointing"] and sparse["data"]["seq_len"] == 524288
    rope = sparse["model"]["rope_scaling"]
    assert rope["original_max_position_embeddings"] * rope["factor"] == 524288
    qwen = _read_recipe(repo / "recipes" / "qwen2.5-3b-cp4-longest.yaml")
    assert qwen["parallel"]["cp_size"] == 4 and qwen["train"]["deepspeed"] == "configs/deepspeed/zero2-offload.json"
    assert qwen["data"]["seq_len"] >= 1 << 20 and qwen["model"]["path"] is None
    assert qwen["attention"]["sparse_policy"] == "always"  # random weights: `auto` would run every layer dense
    # the memory of 256K tokens per GPU: the MLP in chunks (mtrain.planner.memory_terms); the allocator's record off
    # until a run shows whether it caused the SystemError of 2026-11-27 (the recipe's comment)
    assert qwen["model"]["mlp_chunk"] > 0 and qwen["train"]["memory_record"] is False
    parsed = parse_recipe(repo / "recipes" / "qwen2.5-3b-cp4-longest.yaml")
    assert parsed.model.mlp_chunk == 32768 and parsed.model.gradient_checkpointing
    accel = yaml.safe_load((repo / "configs" / "accelerate" / "4gpu.yaml").read_text())
    assert accel["num_processes"] == 4 and accel["distributed_type"] == "DEEPSPEED"
    two = yaml.safe_load((repo / "configs" / "accelerate" / "2gpu.yaml").read_text())  # CP=2 at 512K, the same load
    assert {k: v for k, v in two.items() if k != "num_processes"} == {k: v for k, v in accel.items() if k != "num_processes"}
    assert two["num_processes"] == 2

"""Recipe loading: typed validation, overrides, clear errors naming the key."""

import subprocess
import sys

import pytest
import yaml

from mtrain.config import load_recipe
from mtrain.errors import ConfigError


@pytest.fixture()
def recipe_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "packed").mkdir()
    (tmp_path / "packed" / "index.json").write_text('{"shards": []}')
    (tmp_path / "cfg.json").write_text('{"model_type": "qwen2"}')
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    recipe = {
        "model": {"config": "cfg.json", "tokenizer": "tok"},
        "data": {"path": "packed", "seq_len": 256},
        "train": {"output_dir": "out", "max_steps": 5},
    }
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


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
        ("attention.sample_rows=0", r"attention\.sample_rows: must be a positive integer or null"),
    ],
)
def test_bad_values_name_the_key(recipe_file, override, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe(recipe_file, [override])


def test_one_device_engines_are_refused_under_context_parallelism(recipe_file):
    assert load_recipe(recipe_file, ["attention.engine=fa4"]).attention.engine == "fa4"
    with pytest.raises(ConfigError, match=r"attention\.engine: 'fa4' runs on one device only.*set attention\.engine: auto"):
        load_recipe(recipe_file, ["attention.engine=fa4", "parallel.cp_size=2"])


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
    proc = subprocess.run([sys.executable, "-m", "mtrain", "train", str(recipe_file), "--set", "train.bogus_key=1"],
                          capture_output=True, text=True, cwd=recipe_file.parent)
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
        raw = yaml.safe_load(recipe.read_text())
        overrides = [f"data.path={tmp_path}"]
        if raw["model"].get("path", "").startswith("runs/"):
            overrides.append(f"model.path={tmp_path}")
        r = load_recipe(recipe, overrides)
        assert r.data.seq_len % max(1, r.parallel.cp_size * r.parallel.granularity) == 0, recipe.name

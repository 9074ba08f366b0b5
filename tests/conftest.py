"""Test-wide fixtures."""

import pytest
import yaml


@pytest.fixture
def single_process_group(tmp_path):
    """A gloo process group of this process alone (ring code paths that need a group, on one rank)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture()
def recipe_file(tmp_path, monkeypatch):
    """A minimal valid recipe (r.yaml) in tmp_path, the working directory, with the files its keys name: for tests
    that load it with overrides."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "packed").mkdir()
    (tmp_path / "packed" / "index.json").write_text('{"shards": []}')
    (tmp_path / "cfg.json").write_text('{"model_type": "qwen2"}')
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    recipe = {"model": {"config": "cfg.json", "tokenizer": "tok"}, "data": {"path": "packed", "seq_len": 256},
              "train": {"output_dir": "out", "max_steps": 5}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path

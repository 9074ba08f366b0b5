"""`mtrain eval --attention KIND --sparse KEY=VALUE` and the NIAH heatmap title on narrow grids."""

from __future__ import annotations

import json
import os

import pytest
from test_eval_helpers import tiny_checkpoint

from mtrain.errors import MtrainError
from mtrain.eval.cli import attention_options

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITE_SPARSE = {"attn_implementation": "mtrain-mtraining", "sparse": {"recall": 0.9, "last_q": 32}}


def test_attention_kinds_map_to_backend_options():
    assert attention_options(None, [], {}) == {}
    assert attention_options("dense", [], {}) == {"attn_implementation": "mtrain-dense"}
    assert attention_options("mtrain-mtraining", [], {}) == {"attn_implementation": "mtrain-mtraining"}
    assert attention_options("sdpa", [], {}) == {"attn_implementation": "sdpa"}
    assert attention_options("mtraining", ["recall=0.95", "block_size=64", "sparse_policy=never"], {}) == {
        "attn_implementation": "mtrain-mtraining", "sparse": {"recall": 0.95, "block_size": 64, "sparse_policy": "never"}}
    # without --attention, --sparse refines the suite's own sparse settings; with it, it starts afresh
    assert attention_options(None, ["recall=0.95"], SUITE_SPARSE) == {"sparse": {"recall": 0.95, "last_q": 32}}
    assert attention_options("mtraining", ["recall=0.95"], SUITE_SPARSE)["sparse"] == {"recall": 0.95}
    assert attention_options("mtraining", ["engine=flex"], {})["sparse"] == {"engine": "flex"}


@pytest.mark.parametrize("kind, items, message", [
    ("flash", [], "--attention 'flash': unknown attention kind; choose one of dense, mtraining"),
    ("mtrain-sdpa", [], "unknown attention kind"),
    ("dense", ["recall=0.9"], "--sparse needs a sparse attention kind"),
    (None, ["recall=0.9"], "--sparse needs a sparse attention kind (--attention mtraining or zigzag-sparse), not 'sdpa'"),
    ("mtraining", ["recal=0.9"], "--sparse 'recal=0.9': unknown key 'recal'; valid keys: recall, last_q"),
    ("mtraining", ["recall"], "--sparse 'recall': expected KEY=VALUE"),
    ("mtraining", ["recall=1.5"], "--sparse: attention.recall: must be in (0, 1], got 1.5"),
    ("mtraining", ["block_size=0"], "--sparse: attention.block_size: must be positive, got 0"),
    ("mtraining", ["sparse_policy=sometimes"], "--sparse: attention.sparse_policy: 'sometimes' is not one of auto, always, never"),
    ("mtraining", ["engine=cudnn"], "--sparse: attention.engine: 'cudnn' is not one of auto, triton, flex, fa4"),
])
def test_bad_attention_flags_name_the_problem(kind, items, message):
    with pytest.raises(MtrainError) as err:
        attention_options(kind, items, {})
    assert message in str(err.value)


def test_cli_bad_sparse_key_is_one_line_before_loading(tmp_path, capsys):
    from mtrain.cli import main

    code = main(["eval", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "o"), "--tasks", "niah",
                 "--attention", "mtraining", "--sparse", "bogus=1", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("mtrain eval: error: --sparse 'bogus=1': unknown key 'bogus'")
    code = main(["eval", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "o"), "--tasks", "niah",
                 "--backend", "vllm", "--attention", "mtraining", "--no-progress"])
    assert code == 2 and "use --backend hf" in capsys.readouterr().err


def test_cli_runs_mtraining_attention_with_sparse_settings(tmp_path):
    from mtrain.cli import main

    out = str(tmp_path / "out")
    assert main(["eval", "--model", tiny_checkpoint(), "--out", out, "--tasks", "niah", "--lengths", "512",
                 "--backend", "auto", "--attention", "mtraining", "--sparse", "recall=0.95",
                 "--sparse", "block_size=64", "--no-progress"]) == 0
    backend = json.load(open(os.path.join(out, "manifest.json")))["backend"]
    assert backend["backend"] == "hf" and backend["attn_implementation"] == "mtrain-mtraining"
    assert backend["sparse"] == {"recall": 0.95, "block_size": 64}
    assert os.path.getsize(os.path.join(out, "niah_heatmap.png")) > 0


def test_attention_from_a_recipe_or_a_run_folder_carries_the_training_settings(tmp_path):
    """--attention-from: the kind and every setting the estimate and the per-layer choice read (the quality check and
    recall escalation included), not those only training reads; --sparse refines them; a run folder reads the
    config.yaml training saved."""
    from mtrain.config import parse_recipe

    recipe = os.path.join(REPO, "recipes", "smollm2-32k-mtraining.yaml")
    options = attention_options(None, [], {}, from_path=recipe)
    assert options["attn_implementation"] == "mtrain-mtraining"
    sparse = options["sparse"]
    assert sparse["block_size"] == 64 and sparse["sparse_policy"] == "always" and sparse["recall"] == 0.99
    assert sparse["max_output_error"] == 0.025 and sparse["escalate_recall"] == 0.995
    assert not {"dense_hold_steps", "widen_caps", "widen_max_list_mib"} & set(sparse)  # attention_settings.TRAINING_ONLY
    assert "min_sparse_document" in sparse and "per_document" in sparse  # what an evaluation's per-document path reads
    refined = attention_options(None, ["sparse_policy=never", "recall=0.95"], {}, from_path=recipe)["sparse"]
    assert refined == {**sparse, "sparse_policy": "never", "recall": 0.95}
    run = tmp_path / "run"
    run.mkdir()
    parse_recipe(recipe, ["attention.recall=0.97", "attention.escalate_recall=0.999"]).save(run / "config.yaml")
    from_run = attention_options(None, [], {}, from_path=str(run))["sparse"]
    assert from_run == {**sparse, "recall": 0.97, "escalate_recall": 0.999}
    # a dense recipe names its kind and no sparse settings
    dense = os.path.join(REPO, "recipes", "smollm2-32k-dense.yaml")
    assert attention_options(None, [], {}, from_path=dense) == {"attn_implementation": "mtrain-dense"}


@pytest.mark.parametrize("kind, items, source, message", [
    ("mtraining", [], "recipe", "--attention and --attention-from both choose the attention: give one"),
    (None, [], "empty-dir", "holds no config.yaml"),
    (None, [], "missing", "does not exist; give a recipe YAML or a training run's folder"),
    (None, [], "bad-yaml", "--attention-from"),
    (None, [], "no-check", "bad.yaml: attention.escalate_recall needs attention.max_output_error"),
    (None, ["recall=0.999", "escalate_recall=0.998"], "recipe",
     "--sparse: attention.escalate_recall: must be a number above attention.recall (0.999)"),
    ("mtraining", ["max_output_error=null", "escalate_recall=0.999"], None,
     "--sparse: attention.escalate_recall needs attention.max_output_error"),
    ("mtraining", ["max_output_error=0"], None, "--sparse: attention.max_output_error: must be a number > 0"),
])
def test_bad_attention_source_names_the_problem(tmp_path, kind, items, source, message):
    paths = {"recipe": os.path.join(REPO, "recipes", "smollm2-32k-mtraining.yaml"), "empty-dir": str(tmp_path),
             "missing": str(tmp_path / "nope.yaml"), "bad-yaml": str(tmp_path / "bad.yaml"),
             "no-check": str(tmp_path / "bad.yaml"), None: None}
    # keys only a cross-field check catches reach the same validation as --sparse items
    text = ("  kind: mtraining\n  max_output_error: null\n  escalate_recall: 0.999\n" if source == "no-check"
            else "  recal: 0.9\n")
    (tmp_path / "bad.yaml").write_text("attention:\n" + text)
    with pytest.raises(MtrainError) as err:
        attention_options(kind, items, {}, from_path=paths[source])
    assert message in str(err.value)


def test_sparse_evaluation_runs_the_quality_check_and_escalates(tmp_path):
    """The settings reach the evaluation's attention: with the check at a limit every layer exceeds (1e-9), each
    layer of a one-chunk prefill escalates to the given recall, as in training; with no limit none does."""
    from mtrain.eval.backends.hf import HFBackend
    from mtrain.models.runtime import runtime_of

    ids = list(range(1, 511))
    # named: no check (the default, the recipe's, checks at 0.025)
    settings = {"sparse_policy": "always", "max_output_error": None, "block_size": 64, "last_q": 32, "recall": 0.9}
    plain = HFBackend(tiny_checkpoint(), attn_implementation="mtrain-mtraining", prefill_chunk=1024,
                      sparse=settings, dtype="float32")
    plain.loglikelihood(ids)
    assert runtime_of(plain.model).policy.layer_recall == {}
    checked = HFBackend(tiny_checkpoint(), attn_implementation="mtrain-mtraining", prefill_chunk=1024,
                        sparse={**settings, "max_output_error": 1e-9, "escalate_recall": 0.99}, dtype="float32")
    checked.loglikelihood(ids)
    layers = checked.model.config.num_hidden_layers
    assert runtime_of(checked.model).policy.layer_recall == {layer: 0.99 for layer in range(layers)}
    assert runtime_of(plain.model).policy.layer_recall == {}  # each model keeps its own


@pytest.mark.parametrize("lengths", [1, 2, 4])
def test_niah_heatmap_title_stays_inside_the_figure(lengths):
    from mtrain.eval.plots import niah_figure, _pyplot

    grid = {str(1024 << i): {"0.0": 100.0, "50.0": 0.0, "100.0": 50.0} for i in range(lengths)}
    fig = niah_figure(grid)
    fig.canvas.draw()
    title = fig.axes[0].title.get_window_extent(fig.canvas.get_renderer())
    assert fig.bbox.x0 <= title.x0 and title.x1 <= fig.bbox.x1 and title.y1 <= fig.bbox.y1
    _pyplot().close(fig)


def test_sparse_takes_every_policy_key_an_evaluation_reads_and_refuses_the_training_only_ones():
    """--sparse: the SparseSettings fields and the PolicySettings fields less the training-only ones
    (`mtrain.attention_settings.TRAINING_ONLY`), one list derived from the settings objects."""
    from mtrain.attention_settings import TRAINING_ONLY, PolicySettings, SparseSettings, keys_of
    from mtrain.eval.cli import POLICY_KEYS

    options = attention_options("mtraining", ["min_sparse_document=4096", "per_document=false"], {})
    assert options["sparse"] == {"min_sparse_document": 4096, "per_document": False}
    for key in keys_of(PolicySettings):
        if key in TRAINING_ONLY:
            with pytest.raises(MtrainError, match=f"unknown key '{key}'"):
                attention_options("mtraining", [f"{key}=1"], {})
    with pytest.raises(MtrainError, match="min_sparse_document: must be a positive number of tokens"):
        attention_options("mtraining", ["min_sparse_document=0"], {})
    assert set(POLICY_KEYS) == set(keys_of(PolicySettings)) - set(TRAINING_ONLY)
    assert not set(POLICY_KEYS) & set(keys_of(SparseSettings))

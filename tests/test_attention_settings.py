"""One settings shape (issue #49, item 3): the attention settings are defined once (`mtrain.attention_settings`),
and every entry point (the recipe, the registration, eval, the runtime) reaches the same defaults and refuses a bad
value with the same message, naming the recipe key."""

from __future__ import annotations

import dataclasses

import pytest

from mtrain.attention_settings import BaselineSettings, PolicySettings, SparseSettings, keys_of
from mtrain.config import SETTINGS_KEYS, AttentionConfig
from mtrain.errors import ConfigError


def _fields(obj) -> dict:
    return dataclasses.asdict(obj)


def test_recipe_keys_default_to_the_settings_defaults():
    recipe = AttentionConfig(kind="mtraining")
    for group in (SparseSettings(), PolicySettings(), BaselineSettings()):
        for key, value in _fields(group).items():
            if key in SETTINGS_KEYS:
                assert getattr(recipe, key) == value, key


def test_every_entry_point_has_the_same_defaults():
    from mtrain.eval.backends.hf import HFBackend  # noqa: F401  (eval builds its runtime through attention_runtime)
    from mtrain.eval.cli import attention_options
    from mtrain.models.registry import attention_runtime
    from mtrain.models.runtime import AttentionSettings

    recipe = AttentionConfig(kind="mtraining").settings()
    registered = attention_runtime("mtraining").settings
    # eval: --attention mtraining with no --sparse gives no settings, so the runtime takes the registration's defaults
    assert "sparse" not in attention_options("mtraining", [], {})
    runtime_default = AttentionSettings()
    assert _fields(registered.policy) == _fields(recipe["policy"]) == _fields(runtime_default.policy) \
        == _fields(PolicySettings())
    assert _fields(registered.sparse) == _fields(recipe["sparse"]) == _fields(SparseSettings())
    assert registered.policy.sparse_policy == "auto" and registered.policy.dense_hold == 16
    baseline = attention_runtime("moba").settings.baseline
    assert _fields(baseline) == _fields(recipe["baseline"]) == _fields(BaselineSettings())


@pytest.mark.parametrize("key, value, message", [
    ("recall", 1.5, "attention.recall: must be in (0, 1], got 1.5"),
    ("last_q", 0, "attention.last_q: must be positive, got 0"),
    ("sample_rows", 0, "attention.sample_rows: must be a positive integer or null"),
    ("dense_hold_steps", -1, "attention.dense_hold_steps: must be an integer >= 0"),
    ("max_output_error", 0, "attention.max_output_error: must be a number > 0"),
    ("widen_max_list_mib", -1, "attention.widen_max_list_mib: must be an integer >= 0"),
    ("escalate_recall", 0.9, "attention.escalate_recall: must be a number above attention.recall (0.99)"),
    ("moba_topk", -1, "attention.moba_topk: must be >= 0"),
    ("xattn_threshold", 2.0, "attention.xattn_threshold: must be in (0, 1]"),
])
def test_a_bad_value_is_refused_the_same_way_everywhere(key, value, message):
    from mtrain.eval.cli import attention_options
    from mtrain.models.registry import attention_runtime

    with pytest.raises(ConfigError) as recipe:
        AttentionConfig(kind="mtraining", **{key: value}).settings()
    with pytest.raises(ConfigError) as registration:
        attention_runtime("mtraining", **{key: value})
    assert message in str(recipe.value)
    assert str(recipe.value) == str(registration.value)
    if key in keys_of(SparseSettings) or key in ("max_output_error", "escalate_recall"):
        with pytest.raises(Exception) as evaluation:
            attention_options("mtraining", [f"{key}={value}"], {})
        assert str(evaluation.value) == f"--sparse: {recipe.value}"


def test_registration_takes_the_objects_and_keywords_replace_their_fields():
    from mtrain.models.registry import attention_runtime

    plain = PolicySettings.every_layer_sparse()
    rt = attention_runtime("mtraining", sparse=SparseSettings(recall=0.9), policy=plain, last_q=32)
    assert rt.settings.sparse == SparseSettings(recall=0.9, last_q=32)
    assert rt.settings.policy == plain and rt.settings.policy.sparse_policy == "always" and rt.settings.policy.dense_hold == 0
    with pytest.raises(ConfigError, match="bad attention setting 'recal'; valid settings: recall"):
        attention_runtime("mtraining", recal=0.9)


def test_a_saved_recipe_builds_the_settings_it_trained_with():
    a = AttentionConfig(kind="mtraining", recall=0.995, max_output_error=None, dense_hold_steps=0)
    chosen = a.settings()
    assert chosen["policy"].escalate_recall is None and a.escalate_recall is None  # nothing to escalate to
    assert chosen["policy"].dense_hold_steps == 0 and chosen["sparse"].recall == 0.995


def test_a_runtime_holds_its_policy_as_one_checked_object():
    """AttentionSettings holds the policy as the PolicySettings it was built from (no flat working copy); set_policy
    replaces fields through PolicySettings' own checks, so a bad value is refused naming the key and changes nothing,
    and it returns the policy it replaced."""
    from mtrain.models.registry import attention_runtime

    rt = attention_runtime("mtraining")
    before = rt.settings.policy
    assert isinstance(before, PolicySettings) and before == PolicySettings()
    with pytest.raises(ConfigError, match="attention.dense_hold_steps: must be an integer >= 0"):
        rt.settings.set_policy(dense_hold_steps=-1)
    assert rt.settings.policy is before
    assert rt.settings.set_policy(dense_hold_steps=3, sparse_policy="always") is before
    assert (rt.settings.policy.dense_hold, rt.settings.policy.sparse_policy) == (3, "always")
    assert not any(hasattr(rt.settings, name) for name in ("dense_hold", "sparse_policy", "max_output_error"))

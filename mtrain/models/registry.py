"""The registry of mtrain's attention kinds as HF attention implementations (transformers' AttentionInterface).

`attention_runtime(kind, **settings)` (a recipe's: `recipe_runtime(recipe)`) checks the settings, registers the kind
under the name `mtrain-<kind>` together with a mask function that returns None (no S x S mask is ever built), and
returns a fresh `mtrain.models.runtime.AttentionRuntime` holding the settings; the model is loaded with
`attn_implementation=runtime.name` and the runtime attached to it (`mtrain.models.load_model(..., runtime=)` does
both, or `mtrain.models.runtime.attach_runtime`). The registered functions carry no settings: each model's attention
reads its own runtime, so models loaded with different settings in one process keep theirs. `register_kind` and
`register_attention` register and return just the name (for a caller that builds its runtime elsewhere).

The kinds come from plugins, each a module with `KINDS` (attention.kind -> (sparse?, layout name or None)),
`settings_of(kind, *, sparse_policy, dense_hold, engine, **settings)` (the checked `AttentionSettings`) and
`register(kind)` (the HF registration): the mtraining kinds (`mtrain.models.attention`) and the baselines
(`mtrain.models.baselines`).
"""

from __future__ import annotations

import dataclasses

from mtrain.errors import MtrainError
from mtrain.models import attention, baselines

PLUGINS = (attention, baselines)

# attention.kind -> (sparse?, layout name, or None for the recipe's parallel.layout), over every plugin
KINDS = {kind: facts for plugin in PLUGINS for kind, facts in plugin.KINDS.items()}
_PLUGIN_OF = {kind: plugin for plugin in PLUGINS for kind in plugin.KINDS}


def register_attention(recipe) -> str:
    """Register the recipe's attention kind with transformers (its settings checked); return the `attn_implementation`
    name. The settings reach a model through its runtime: `recipe_runtime`."""
    kind, options = recipe_attention(recipe.attention)
    return register_kind(kind, **options)


def recipe_runtime(recipe):
    """A fresh runtime of the recipe's attention kind (`attention_runtime` with the recipe's `attention:` keys), with
    the recipe's switches (`mtrain.ops.switches.from_recipe`), which its attention calls pass down the stack."""
    from mtrain.ops.switches import from_recipe

    kind, options = recipe_attention(recipe.attention)
    return attention_runtime(kind, switches=from_recipe(recipe), **options)


def recipe_attention(a) -> tuple[str, dict]:
    """A recipe's `attention:` section (`mtrain.config.AttentionConfig`) as `register_kind`'s arguments: the kind and
    its keywords (sparse_policy, dense_hold, engine and the settings the kind reads). `mtrain eval --attention-from`
    evaluates with these, so a model is judged with the attention it trained with."""
    from mtrain.parallel import SparseSettings

    # Every recipe key under `attention:` that is also a SparseSettings field reaches the estimator.
    shared = {f.name for f in dataclasses.fields(SparseSettings)}
    if a.kind in baselines.BASELINE_KINDS:  # they take the recipe's baseline keys and ignore the rest
        shared = {f.name for f in dataclasses.fields(a)} - {"kind", "sparse_policy", "dense_hold_steps", "engine",
                                                             "max_output_error", "widen_caps",
                                                             "widen_max_list_mib", "escalate_recall", "per_document",
                                                             # switches: the runtime's (`recipe_runtime`)
                                                             "graph_estimate", "lagged_choice", "cost_table"}
    settings = {f.name: getattr(a, f.name) for f in dataclasses.fields(a) if f.name in shared}
    if a.kind not in baselines.BASELINE_KINDS:
        settings["max_output_error"] = a.max_output_error
        settings["widen_caps"] = a.widen_caps
        settings["widen_max_list_mib"] = a.widen_max_list_mib
        settings["escalate_recall"] = a.escalate_recall
        settings["per_document"] = a.per_document
    return a.kind, {"sparse_policy": a.sparse_policy, "dense_hold": a.dense_hold_steps, "engine": a.engine, **settings}


def attention_runtime(kind: str, *, sparse_policy: str = "always", dense_hold: int = 0, engine: str = "auto",
                      switches=None, **sparse_settings):
    """A fresh `mtrain.models.runtime.AttentionRuntime` for attention kind `kind` (see KINDS) with these settings,
    the kind registered with transformers as `mtrain-<kind>` (the runtime's `name`). Sparse kinds take
    `mtrain.parallel.SparseSettings` fields as keywords, and `sparse_policy` (`mtrain.models.policy.SPARSE_POLICIES`;
    the recipe's attention.sparse_policy, default "auto", reaches it through `recipe_runtime`; called directly a
    sparse kind runs sparse on every layer unless told otherwise), `engine` (`mtrain.models.attention.ENGINES`:
    the block kernels of the sparse path on one device), `max_output_error` (the quality check of "auto"),
    `widen_caps` and `widen_max_list_mib` (the cap widening of "auto"), `escalate_recall`, `per_document` (see
    `mtrain.models.attention.settings_of`); the baselines take `BaselineSettings` fields and ignore the rest.
    switches: the `mtrain.ops.switches.Switches` its attention runs with (None: the defaults; a recipe's:
    `recipe_runtime`). Attach it to the model loaded with `attn_implementation=runtime.name`
    (`mtrain.models.runtime.attach_runtime`)."""
    from mtrain.models.runtime import AttentionRuntime

    if kind not in KINDS:
        raise MtrainError(f"attention kind '{kind}' has no mtrain implementation; use one of {', '.join(KINDS)}")
    plugin = _PLUGIN_OF[kind]
    settings = plugin.settings_of(kind, sparse_policy=sparse_policy, dense_hold=dense_hold, engine=engine,
                                  **sparse_settings)
    plugin.register(kind)
    if switches is not None:
        settings.switches = switches
    return AttentionRuntime(settings)


def register_kind(kind: str, **settings) -> str:
    """Register attention kind `kind` with transformers, its settings checked (`attention_runtime`'s keywords);
    returns the `attn_implementation` name. The settings reach a model only through the runtime attached to it:
    use `attention_runtime` for one."""
    return attention_runtime(kind, **settings).name


def layout_name(recipe) -> str:
    """The sequence layout an attention kind runs on (zigzag kinds force zigzag)."""
    forced = KINDS.get(recipe.attention.kind, (False, None))[1]
    return forced or recipe.parallel.layout

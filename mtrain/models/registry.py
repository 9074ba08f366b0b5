"""The registry of mtrain's attention kinds as HF attention implementations (transformers' AttentionInterface).

`register_attention(recipe)` registers the recipe's kind under the name `mtrain-<kind>` together with a mask
function that returns None (no S x S mask is ever built); the trainer loads the model with `attn_implementation=`
that name. The kinds come from plugins, each a module with `KINDS` (attention.kind -> (sparse?, layout name or
None)) and `register(kind, *, sparse_policy, dense_hold, engine, **settings)`: the mtraining kinds
(`mtrain.models.attention`) and the baselines (`mtrain.models.baselines`). Per-batch facts the attention needs
live in `mtrain.models.context.CONTEXT`.
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
    """Register the recipe's attention kind with transformers; return the `attn_implementation` name."""
    kind, options = recipe_attention(recipe.attention)
    return register_kind(kind, **options)


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
                                                             # switches: the trainer sets them (mtrain.ops.switches)
                                                             "graph_estimate", "lagged_choice", "cost_table"}
    settings = {f.name: getattr(a, f.name) for f in dataclasses.fields(a) if f.name in shared}
    if a.kind not in baselines.BASELINE_KINDS:
        settings["max_output_error"] = a.max_output_error
        settings["widen_caps"] = a.widen_caps
        settings["widen_max_list_mib"] = a.widen_max_list_mib
        settings["escalate_recall"] = a.escalate_recall
        settings["per_document"] = a.per_document
    return a.kind, {"sparse_policy": a.sparse_policy, "dense_hold": a.dense_hold_steps, "engine": a.engine, **settings}


def register_kind(kind: str, *, sparse_policy: str = "always", dense_hold: int = 0, engine: str = "auto",
                  **sparse_settings) -> str:
    """Register attention kind `kind` (see KINDS) as `mtrain-<kind>` through its plugin; sparse kinds take
    `mtrain.parallel.SparseSettings` fields as keywords, and `sparse_policy` (`mtrain.models.policy.SPARSE_POLICIES`;
    the recipe's attention.sparse_policy, default "auto", reaches it through `register_attention`; called directly a
    sparse kind runs sparse on every layer unless told otherwise), `engine` (`mtrain.models.attention.ENGINES`:
    the block kernels of the sparse path on one device), `max_output_error` (the quality check of "auto"),
    `widen_caps` and `widen_max_list_mib` (the cap widening of "auto"), `escalate_recall` (see
    `mtrain.models.attention.register`); the baselines take `BaselineSettings` fields and ignore
    the rest. Returns the `attn_implementation` name.
    Each name carries its own settings; registering a name again replaces them for every model using it."""
    if kind not in KINDS:
        raise MtrainError(f"attention kind '{kind}' has no mtrain implementation; use one of {', '.join(KINDS)}")
    return _PLUGIN_OF[kind].register(kind, sparse_policy=sparse_policy, dense_hold=dense_hold, engine=engine,
                                     **sparse_settings)


def layout_name(recipe) -> str:
    """The sequence layout an attention kind runs on (zigzag kinds force zigzag)."""
    forced = KINDS.get(recipe.attention.kind, (False, None))[1]
    return forced or recipe.parallel.layout

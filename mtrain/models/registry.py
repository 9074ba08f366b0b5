"""The registry of mtrain's attention kinds as HF attention implementations (transformers' AttentionInterface).

`attention_runtime(kind, sparse=, policy=, baseline=)` (the `mtrain.attention_settings` objects, or their fields
as keywords; a recipe's: `recipe_runtime(recipe)`) checks the settings, registers the kind
under the name `mtrain-<kind>` together with a mask function that returns None (no S x S mask is ever built), and
returns a fresh `mtrain.models.runtime.AttentionRuntime` holding the settings; the model is loaded with
`attn_implementation=runtime.name` and the runtime attached to it (`mtrain.models.load_model(..., runtime=)` does
both, or `mtrain.models.runtime.attach_runtime`). The registered functions carry no settings: each model's attention
reads its own runtime, so models loaded with different settings in one process keep theirs. `register_kind` and
`register_attention` register and return just the name (for a caller that builds its runtime elsewhere).

The kinds come from plugins, each a module with `KINDS` (attention.kind -> (sparse?, layout name or None)),
`settings_of(kind, *, sparse, policy, baseline)` (the `AttentionSettings` of the checked settings objects) and
`register(kind)` (the HF registration): the mtraining kinds (`mtrain.models.attention`) and the baselines
(`mtrain.models.baselines`).
"""

from __future__ import annotations

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
    """A fresh runtime of the recipe's attention kind (`attention_runtime` with the recipe's `attention:` settings),
    with the recipe's switches (`mtrain.ops.switches.from_recipe`), which its attention calls pass down the stack."""
    from mtrain.ops.switches import from_recipe

    kind, options = recipe_attention(recipe.attention)
    return attention_runtime(kind, switches=from_recipe(recipe), **options)


def recipe_attention(a) -> tuple[str, dict]:
    """A recipe's `attention:` section (`mtrain.config.AttentionConfig`) as `attention_runtime`'s arguments: the kind
    and its settings objects ({"sparse", "policy", "baseline"}: `AttentionConfig.settings()`). `mtrain eval
    --attention-from` evaluates with these, so a model is judged with the attention it trained with."""
    return a.kind, a.settings()


def attention_runtime(kind: str, *, sparse=None, policy=None, baseline=None, switches=None, **keys):
    """A fresh `mtrain.models.runtime.AttentionRuntime` for attention kind `kind` (see KINDS) with these settings,
    the kind registered with transformers as `mtrain-<kind>` (the runtime's `name`). The settings are the objects of
    `mtrain.attention_settings`: `sparse` (`SparseSettings`: the vertical-slash estimate of the sparse kinds),
    `policy` (`PolicySettings`: sparse_policy, engine, the quality check, escalation, hold, widening, per-document)
    and `baseline` (`BaselineSettings`: moba / xattention), each None for its defaults, which are the recipe's
    (sparse_policy auto with the quality check: a caller that wants every layer sparse names
    `PolicySettings.every_layer_sparse()`). `keys`: fields of those objects by name (the recipe's `attention:` keys,
    e.g. recall=0.9, sparse_policy="always"), which replace the given objects' (`settings_from_keys`: one validation,
    the recipe's messages). A kind reads only its own: the sparse kinds the sparse and policy settings, the baselines
    the baseline settings. switches: the `mtrain.ops.switches.Switches` its attention runs with (None: the defaults;
    a recipe's: `recipe_runtime`). Attach it to the model loaded with `attn_implementation=runtime.name`
    (`mtrain.models.runtime.attach_runtime`)."""
    from mtrain.attention_settings import settings_from_keys
    from mtrain.models.runtime import AttentionRuntime

    if kind not in KINDS:
        raise MtrainError(f"attention kind '{kind}' has no mtrain implementation; use one of {', '.join(KINDS)}")
    plugin = _PLUGIN_OF[kind]
    chosen = settings_from_keys(kind, keys, sparse=sparse, policy=policy, baseline=baseline)
    settings = plugin.settings_of(kind, **chosen)
    plugin.register(kind)
    if switches is not None:
        settings.switches = switches
    return AttentionRuntime(settings)


def register_kind(kind: str, **settings) -> str:
    """Register attention kind `kind` with transformers, its settings checked (`attention_runtime`'s arguments);
    returns the `attn_implementation` name. The settings reach a model only through the runtime attached to it:
    use `attention_runtime` for one."""
    return attention_runtime(kind, **settings).name


def layout_name(recipe) -> str:
    """The sequence layout an attention kind runs on (zigzag kinds force zigzag)."""
    forced = KINDS.get(recipe.attention.kind, (False, None))[1]
    return forced or recipe.parallel.layout

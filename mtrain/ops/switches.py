"""The run's switches below the model: settings that change the speed or the results of the attention stack and are
read deep inside it (the estimates' CUDA graphs, the lagged choice, the ring's list-free columns and static widths,
the gathered schedule's backward and sink, the fused merge, the hierarchical ring, the cost table).

Each is a typed recipe key under `attention:` or `parallel:` (`mtrain.config`), saved in the run's config.yaml.
`Switches` is immutable (a frozen dataclass: another set of switches is `dataclasses.replace(switches, ...)`), and
nothing in the process holds a current one: they travel as arguments. A model's attention runtime
(`mtrain.models.runtime.AttentionSettings.switches`; the trainer's are the recipe's, `from_recipe`) hands its own to
every call of the attention stack it makes, down to each reader; the public functions of `mtrain.ops` and
`mtrain.parallel` that read one take a `switches=` keyword (None: the documented defaults, `DEFAULTS`), and the
autograd functions whose backward reads one keep the switches their forward ran with. So two models with different
switches in one process each run, forward and backward, with their own. A benchmark or a test passes its own
(`Switches(...)`, or `dataclasses.replace(DEFAULTS, ...)`).

`Switches` lives in the lowest layer of the stack (ops < parallel < models) so that every layer can name it; the
defaults here are the recipe keys' defaults.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Switches:
    """The switches a run's attention runs with (see the module docstring); each field's recipe key is in KEYS, and
    its meaning in that key's docstring in `mtrain.config`. Immutable: change one with `dataclasses.replace`."""

    graph_estimate: bool = True
    """attention.graph_estimate: the one-device estimate replayed from a CUDA graph (`mtrain.ops.graphed`)."""
    lagged_choice: bool = True
    """attention.lagged_choice: under "auto" on one device, a layer decides from its previous estimate's figures
    (`mtrain.models.policy`)."""
    cost_table: str | None = None
    """attention.cost_table: a JSON file of cost-model figures (`mtrain.ops.cost.table_for`); None = the built-in
    ones, or the file MTRAIN_COST_TABLE names."""
    graph_ring_estimate: bool = False
    """parallel.graph_ring_estimate: the context-parallel estimate replayed from a CUDA graph
    (`mtrain.parallel.graphed`)."""
    list_free_columns: bool = True
    """parallel.list_free_columns: a CP rank whose lists would pass static_width_bytes holds no column lists
    (`mtrain.parallel.estimate.columns_list_free`)."""
    static_width_bytes: int = 64 * 2**20
    """parallel.static_width_mib, in bytes: a CP rank's lists up to this size take static widths, without a host
    read (`mtrain.parallel.estimate.rank_list_widths`)."""
    fused_merge: bool = True
    """parallel.fused_merge: the ring's LSE merge and the owners' dK/dV sum in one Triton pass on the GPU
    (`mtrain.parallel.merge`)."""
    gather_backward: str = "auto"
    """parallel.gather_backward: the gathered step's backward under the fa4 engine
    (`mtrain.parallel.ring_gather.gathered_backward`)."""
    gather_sink: str = "replicas"
    """parallel.gather_sink: how the gathered plan holds the sink block under FA4's backward
    (`mtrain.parallel.ring_gather.gathered_sink_form`)."""
    hierarchy: str = "auto"
    """parallel.hierarchy: flat ring, hierarchical ring, or auto (`mtrain.parallel.comm.ring_node_size`)."""
    node_size: int | None = None
    """parallel.node_size: ranks per node of the hierarchical ring; None = LOCAL_WORLD_SIZE (the launcher's)."""


DEFAULTS = Switches()
"""The documented defaults (the recipe keys' defaults): what a `switches=None` argument means."""


def or_defaults(switches: Switches | None) -> Switches:
    """`switches`, or `DEFAULTS` for None (the readers' `switches=` keyword)."""
    return DEFAULTS if switches is None else switches


# Switches field -> the recipe key it is copied from ("section.key"); every field has one.
KEYS = {
    "graph_estimate": "attention.graph_estimate",
    "lagged_choice": "attention.lagged_choice",
    "cost_table": "attention.cost_table",
    "graph_ring_estimate": "parallel.graph_ring_estimate",
    "list_free_columns": "parallel.list_free_columns",
    "static_width_bytes": "parallel.static_width_mib",
    "fused_merge": "parallel.fused_merge",
    "gather_backward": "parallel.gather_backward",
    "gather_sink": "parallel.gather_sink",
    "hierarchy": "parallel.hierarchy",
    "node_size": "parallel.node_size",
}
# Fields whose recipe key counts in other units: the factor from the key's unit to the field's.
SCALES = {"static_width_bytes": 2**20}


def from_sections(attention, parallel) -> Switches:
    """The Switches of a recipe's `attention:` and `parallel:` sections (`mtrain.config.AttentionConfig` and
    `ParallelConfig`, or anything with those attributes)."""
    sections = {"attention": attention, "parallel": parallel}
    values = {}
    for name, key in KEYS.items():
        section, field = key.split(".")
        value = getattr(sections[section], field)
        values[name] = value * SCALES[name] if name in SCALES else value
    return Switches(**values)


def from_recipe(recipe) -> Switches:
    """The Switches of a recipe (`mtrain.config.RecipeConfig`): `from_sections` of its `attention:` and `parallel:`."""
    return from_sections(recipe.attention, recipe.parallel)

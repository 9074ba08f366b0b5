"""The run's switches below the model: settings that change the speed or the results of the attention stack and are
read deep inside it (the estimates' CUDA graphs, the lagged choice, the ring's list-free columns and static widths,
the gathered schedule's backward and sink, the fused merge, the hierarchical ring, the cost table).

Each is a typed recipe key under `attention:` or `parallel:` (`mtrain.config`), saved in the run's config.yaml; the
trainer copies them here from the recipe before the first forward (`configure`), and the readers read `SWITCHES` at
call time. `SWITCHES` lives in the lowest layer of the stack (ops < parallel < models) so that every layer can read
it; the defaults here are the recipe keys' defaults. A benchmark or a test changes one for a block with `use`.

A model's attention runtime (`mtrain.models.runtime`) carries its own `Switches` (the trainer's are the recipe's):
each of its attention calls puts them in place for the call (`applied`), so two models with different switches each
run with their own. The readers deep in ops/parallel still read `SWITCHES`: what runs outside an attention call (the
backward of an attention op) reads the process's, which the trainer sets with `configure`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass


@dataclass
class Switches:
    """The switches a run's attention reads at call time (see the module docstring); each field's recipe key is in
    KEYS, and its meaning in that key's docstring in `mtrain.config`."""

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


SWITCHES = Switches()

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


def configure(attention, parallel) -> Switches:
    """Set SWITCHES from a recipe's `attention:` and `parallel:` sections (the trainer does, before the first
    forward); returns it."""
    chosen = from_sections(attention, parallel)
    for f in dataclasses.fields(Switches):
        setattr(SWITCHES, f.name, getattr(chosen, f.name))
    return SWITCHES


@contextlib.contextmanager
def use(**values):
    """Within the block, SWITCHES with `values` (field=value) in place of the current ones; restored after."""
    unknown = set(values) - {f.name for f in dataclasses.fields(Switches)}
    if unknown:
        raise TypeError(f"unknown switch(es) {', '.join(sorted(unknown))}; fields: {', '.join(KEYS)}")
    saved = {name: getattr(SWITCHES, name) for name in values}
    for name, value in values.items():
        setattr(SWITCHES, name, value)
    try:
        yield SWITCHES
    finally:
        for name, value in saved.items():
            setattr(SWITCHES, name, value)


def applied(switches: Switches | None):
    """Within the block, SWITCHES set to every field of `switches` (a model's own, `mtrain.models.runtime`), restored
    after; a no-op context for None. The model's attention calls run under their runtime's switches this way; the
    readers deep in the stack still read SWITCHES."""
    if switches is None:
        return contextlib.nullcontext(SWITCHES)
    return use(**{f.name: getattr(switches, f.name) for f in dataclasses.fields(Switches)})

"""One decision for a sparse layer's call wherever it runs (`mtrain.models.decision.decide`): one device and every rank
of a context-parallel group call the same function (a spy on it, on one device and on 2 gloo ranks), and on the ring
the sequence of calls that exercises each of its steps (the quality check and its escalation, the widened caps, the
dense hold and its skipped estimates, the replayed choice under recomputation, the sampled true recall and
imbalance) leaves the records and policy state pinned below, the same on both ranks. The pins are what the ring's
own copy of the sequence (before `decide`) left on these inputs."""

from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest
import torch

SEQ, HQ, HKV, D, BS = 1024, 4, 2, 16, 32


def _inputs(kind: str):
    """q, k, v [1, SEQ, H, D]: "local" (each query's mass near its diagonal: sparse pays) or "flat" (no line stands
    out: the recall target needs most of the pattern)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, SEQ, HQ, D, generator=g)
    k, v = (torch.randn(1, SEQ, HKV, D, generator=g) for _ in range(2))
    if kind == "flat":
        return q * 0.01, k * 0.01, v
    angle = torch.arange(SEQ)[:, None] * 0.5 ** torch.arange(D // 2)[None, :]
    feat = torch.cat([angle.cos(), angle.sin()], -1)[None, :, None, :]
    return 2.0 * feat.expand(1, SEQ, HQ, D) + 0.3 * q, feat.expand(1, SEQ, HKV, D) + 0.3 * k, v


# name -> (policy settings changed on the runtime, mtrain_attention's keywords, input kind, steps, schedule)
def _scenarios():
    from mtrain.parallel import SparseSettings

    local = SparseSettings(recall=0.4, block_size=BS, max_vertical=4, max_slash=4, min_vertical=0, min_slash=0)
    wide = dataclasses.replace(local, max_vertical=64, max_slash=64)
    tight = SparseSettings(recall=0.95, block_size=BS, max_vertical=2, max_slash=2, min_vertical=0, min_slash=0)
    return {
        "check-escalates": ({"escalate_recall": 0.46, "dense_hold_steps": 2}, dict(settings=wide, max_error=1e-3),
                            "local", 4, "ring"),
        "check-passes": ({"escalate_recall": 0.46, "dense_hold_steps": 2}, dict(settings=wide, max_error=10.0), "local", 4,
                         "ring"),
        "check-passes-gathered": ({"escalate_recall": 0.46, "dense_hold_steps": 2}, dict(settings=wide, max_error=10.0),
                                  "local", 2, "gather"),
        "widens-then-holds": ({"dense_hold_steps": 2}, dict(settings=tight, max_error=None), "local", 5, "ring"),
        "flat-holds": ({"dense_hold_steps": 2, "widen_caps": False}, dict(settings=local, max_error=None), "flat", 3, "ring"),
    }


FIELDS = ("path", "held", "widened", "cap_scale", "escalated_recall", "checked", "true_recall", "imbalances", "density",
          "dense_until", "hold_streak", "checked_until", "layer_cap_scale", "layer_recall")
"""A ring call's row: its record (whether the check measured it and the true recall was sampled; how many imbalance
figures it took; its density to 6 places), then the layer's policy state after it."""


def _call(rt, shard, kwargs) -> list:
    """One training call of layer 0 under "auto" and its recomputation: [its row (FIELDS), its figures exactly,
    whether the recomputation ran the same path bit for bit and recorded nothing]."""
    from mtrain.models.attention import mtrain_attention

    module = SimpleNamespace(training=True, layer_idx=0, mtrain_runtime=rt)
    args = [t.transpose(1, 2).clone().requires_grad_(True) for t in shard]
    out, _ = mtrain_attention(module, *args, None, policy="auto", **kwargs)
    (r,) = rt.records.layers
    rt.records.layers.clear()
    rt.inputs.recomputing = True
    again, _ = mtrain_attention(module, *args, None, policy="auto", **kwargs)
    rt.inputs.recomputing = False
    p = rt.policy
    density = None if r.density is None else round(float(r.density), 6)
    row = [r.path, r.held, r.widened, r.cap_scale, r.escalated_recall, r.output_error is not None,
           r.true_recall is not None, len(rt.records.imbalances), density,
           *(getattr(p, name).get(0) for name in ("dense_until", "hold_streak", "checked_until", "cap_scale",
                                                   "layer_recall"))]
    figures = [None if t is None else t.tolist() for t in (r.density, r.output_error, r.true_recall)]
    rt.records.imbalances.clear()
    return [row, figures, torch.equal(out, again) and not rt.records.layers]


def _worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from mtrain.attention_settings import PolicySettings
    from mtrain.models import decision
    from mtrain.models.runtime import AttentionRuntime, AttentionSettings
    from mtrain.ops import cost
    from mtrain.parallel import Layout

    sites = []
    real = decision.decide

    def spy(rt, q, s, site, **kwargs):
        sites.append(type(site).__name__)
        return real(rt, q, s, site, **kwargs)

    decision.decide = spy
    cost.CPU = dataclasses.replace(cost.CPU, estimate=(0.0, 0.0))  # the choice between the kernels alone
    layout = Layout.create("block-stripe", world_size=world, granularity=BS)
    got = {}
    for name, (changes, kwargs, kind, steps, schedule) in _scenarios().items():
        rt = AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse()))
        # the quality check's limit the calls pass, which the escalation needs
        rt.settings.set_policy(max_output_error=kwargs["max_error"], **changes)
        rt.topology.group, rt.topology.layout, rt.topology.schedule = dist.group.WORLD, layout, schedule
        shard = [layout.shard(t, rank) for t in _inputs(kind)]
        calls = []
        for step in range(steps):
            rt.inputs.step, rt.inputs.sample_recall, rt.inputs.recall_rows = step, step % 2 == 0, 16
            rt.inputs.sample_imbalance = True
            calls.append(_call(rt, shard, kwargs))
        got[name] = calls
    got["sites"] = sites
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ring_calls(tmp_path_factory):
    """What each of 2 gloo ranks recorded (`_worker`)."""
    from ranks import run_ranks

    tmp = tmp_path_factory.mktemp("decision")
    run_ranks(_worker, 2, (2, str(tmp / "init"), str(tmp)))
    return [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_one_device_and_a_cp_rank_decide_through_one_function(monkeypatch, ring_calls):
    """The same `decide` on one device (whole sequence, and each packed document) and on each CP rank, where the
    site differs: every ring call of `_worker` went through it, its recomputation too (the replay is its first step)."""
    from mtrain.attention_settings import PolicySettings
    from mtrain.models import decision
    from mtrain.models.attention import mtrain_attention
    from mtrain.models.runtime import AttentionRuntime, AttentionSettings
    from mtrain.parallel import SparseSettings

    sites = []
    real = decision.decide
    monkeypatch.setattr(decision, "decide", lambda rt, q, s, site, **kw: sites.append(type(site).__name__)
                        or real(rt, q, s, site, **kw))
    rt = AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse()))
    module = SimpleNamespace(training=False, layer_idx=0, mtrain_runtime=rt)
    q, k, v = (t.transpose(1, 2) for t in _inputs("local"))
    settings = SparseSettings(recall=0.4, block_size=BS, max_vertical=4, max_slash=4)
    mtrain_attention(module, q, k, v, None, settings=settings, policy="always")
    rt.set_documents((torch.arange(SEQ) >= 200).long()[None])  # two documents, each decided on its own
    mtrain_attention(module, q, k, v, None, settings=settings, policy="always")
    assert sites == ["OneDevice"] * 3
    calls = sum(steps for *_, steps, _ in _scenarios().values())
    for rank in ring_calls:
        assert rank["sites"] == ["RankOfGroup"] * (2 * calls)  # each call and its recomputation


# per scenario, per step: the call's row (FIELDS)
PINNED = {
    "check-escalates": [  # over the limit: escalated to 0.46, still over it, held dense 2 steps, then held 4
        ("dense", False, False, 1, 0.46, True, False, 0, 0.183262, 3, 1, None, None, 0.46),
        ("dense", True, False, 1, None, False, False, 0, None, 3, 1, None, None, 0.46),
        ("dense", True, False, 1, None, False, False, 0, None, 3, 1, None, None, 0.46),
        ("dense", False, False, 1, 0.46, True, False, 0, 0.183262, 8, 2, None, None, 0.46),
    ],
    "check-passes": [  # sparse; the check measured once per hold period; recall sampled on even steps
        ("sparse", False, False, 1, None, True, True, 1, 0.15122, None, None, 3, None, None),
        ("sparse", False, False, 1, None, False, False, 1, 0.15122, None, None, 3, None, None),
        ("sparse", False, False, 1, None, False, True, 1, 0.15122, None, None, 3, None, None),
        ("sparse", False, False, 1, None, True, False, 1, 0.15122, None, None, 6, None, None),
    ],
    "check-passes-gathered": [  # the gathered schedule decides alike
        ("sparse", False, False, 1, None, True, True, 1, 0.15122, None, None, 3, None, None),
        ("sparse", False, False, 1, None, False, False, 1, 0.15122, None, None, 3, None, None),
    ],
    "widens-then-holds": [  # short of the recall with binding caps: caps 2x, 4x, 8x, then the hold
        ("dense", False, True, 1, None, False, False, 0, 0.15471, None, None, None, 2, None),
        ("dense", False, True, 2, None, False, False, 0, 0.158201, None, None, None, 4, None),
        ("dense", False, True, 4, None, False, False, 0, 0.16503, None, None, None, 8, None),
        ("dense", False, False, 8, None, False, False, 0, 0.178902, 6, 1, None, 8, None),
        ("dense", True, False, 8, None, False, False, 0, None, 6, 1, None, 8, None),
    ],
    "flat-holds": [  # the cost model's dense: held, its estimates skipped
        ("dense", False, False, 1, None, False, False, 0, 0.158293, 3, 1, None, None, None),
        ("dense", True, False, 1, None, False, False, 0, None, 3, 1, None, None, None),
        ("dense", True, False, 1, None, False, False, 0, None, 3, 1, None, None, None),
    ],
}


def test_the_rings_records_and_policy_state_are_pinned_and_equal_across_ranks(ring_calls):
    for rank in ring_calls:
        for name in _scenarios():
            for row, _, replayed in rank[name]:
                assert replayed, (name, row)  # the recomputation ran the first forward's path, recording nothing
    first, second = ring_calls
    assert {name: first[name] for name in _scenarios()} == {name: second[name] for name in _scenarios()}
    got = {name: [tuple(row) for row, _, _ in first[name]] for name in _scenarios()}
    assert got == PINNED

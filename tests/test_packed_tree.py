"""`mtrain.ops.graphed.PackedTree`: what a CUDA-graph replay copies out (the context-parallel estimate's rank index
with its gathered plan in the cache) comes back equal, sharing no memory with the packed tree except the tensors
kept by identity; `same_tree` tells equal trees from changed ones."""

import torch

from mtrain.ops.graphed import PackedTree, same_tree
from mtrain.ops.index import rows_from_lines
from mtrain.parallel import Layout
from mtrain.parallel.plan import gathered_sparse_plan, rank_blocks

SEQ, BLOCK, WORLD = 256, 16, 2


def _rank_index(rank=0):
    g = torch.Generator().manual_seed(5)
    vertical = torch.sort(torch.randint(0, SEQ, (1, 4, 6), generator=g), -1).values
    slash = torch.cat([torch.arange(0, 3 * BLOCK, BLOCK).expand(1, 4, 3), torch.full((1, 4, 1), 5 * BLOCK)], -1)
    layout = Layout.create("block-stripe", world_size=WORLD, granularity=BLOCK)
    rows = rank_blocks(layout, SEQ, rank, BLOCK, torch.device("cpu"))
    index = rows_from_lines(vertical, slash, SEQ, BLOCK, rows, check=False, bound_widths="static")
    index._cache["lines"] = (vertical, slash, rows)
    index._cache["est_recall"] = torch.rand(1, 4, generator=g)
    plan = gathered_sparse_plan(index, layout, rank, torch.device("cpu"))  # cached in index._cache
    assert plan is not None
    return index, rows


def test_a_packed_rank_index_unpacks_equal_and_apart():
    index, rows = _rank_index()
    packed = PackedTree(index, keep=(rows,))
    out = packed.unpack()
    assert type(out) is type(index) and same_tree(out, index)
    assert out.rows is rows and out._cache["lines"][2] is rows  # kept by identity: plans test the rows so
    assert out.col_ids.data_ptr() != index.col_ids.data_ptr()
    before = index.block_ids.clone()
    out.block_ids.fill_(-7)  # a replay's copy is the caller's own
    assert torch.equal(index.block_ids, before)
    again = packed.unpack()
    assert same_tree(again, index) and again.block_ids.data_ptr() != out.block_ids.data_ptr()
    plan_key = next(key for key in index._cache if isinstance(key, tuple) and key[0] == "gathered_plan")
    a, b = again._cache[plan_key], index._cache[plan_key]
    assert torch.equal(a.steps[0].ids, b.steps[0].ids) and torch.equal(a.columns.ids, b.columns.ids)


def test_same_tree_sees_a_changed_entry_and_a_changed_shape():
    index, rows = _rank_index()
    other = PackedTree(index, keep=(rows,)).unpack()
    assert same_tree(other, index)
    other.col_ids.view(-1)[0] += 1
    assert not same_tree(other, index)
    shorter = PackedTree(index).unpack()
    shorter.col_ids = shorter.col_ids[..., :-1]
    assert not same_tree(shorter, index)
    recall = PackedTree(index).unpack()
    recall._cache["est_recall"] += 1e-3
    assert not same_tree(recall, index)


def test_named_tuples_inside_a_tree_come_back_as_themselves():
    """FA4's block-sparse lists are a named tuple (`BlockSparseTensorsTorch`) kept in the plans' caches: packing
    (and the ring's save_for_backward, through the same split / join) must rebuild it from its fields."""
    import collections
    import dataclasses

    from mtrain.ops.partial_autograd import join_tensors, split_tensors

    Lists = collections.namedtuple("Lists", ["cnt", "idx", "block_size"])

    @dataclasses.dataclass
    class Holder:
        fwd: object
        extra: tuple

    tree = {"fa4": Holder(Lists(torch.arange(3), torch.ones(2, 2, dtype=torch.int32), (128, 128)),
                          (torch.zeros(1), 5))}
    tensors: list = []
    split = split_tensors(tree, tensors)
    assert len(tensors) == 3 and isinstance(split["fa4"].fwd, Lists)
    back = join_tensors(split, tensors)
    assert isinstance(back["fa4"].fwd, Lists) and back["fa4"].fwd.block_size == (128, 128)
    assert back["fa4"].fwd.cnt is tensors[0] and back["fa4"].extra[1] == 5
    out = PackedTree(tree).unpack()
    assert isinstance(out["fa4"].fwd, Lists) and same_tree(out, tree)


def test_what_a_layer_keeps_of_a_replayed_index_owns_its_memory():
    # A replayed index's tensors are views into one flat buffer (as `PackedTree.unpack` returns them): the record
    # the layer logs (its estimated recall) and the lines it keeps for the recomputation must not be those views,
    # or every layer's whole buffer (lists and plans) stays alive until the step ends (an evaluation: forever).
    from mtrain.models.policy import record_layer, remember_choice
    from mtrain.attention_settings import PolicySettings
    from mtrain.models.runtime import AttentionRuntime, AttentionSettings

    index, rows = _rank_index()
    replayed = PackedTree(index, keep=(rows,)).unpack()
    flat_bytes = replayed.col_ids.untyped_storage().nbytes()
    assert flat_bytes > replayed.col_ids.numel() * 4  # the setting: a view into a larger buffer
    RT = AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse()))
    try:
        record_layer(RT, 3, "sparse", replayed, None)
        with torch.enable_grad():
            remember_choice(RT, 3, "sparse", replayed, training=True)
        recall = RT.records.layers[-1].est_recall
        assert torch.equal(recall, replayed._cache["est_recall"])
        assert recall.untyped_storage().nbytes() == recall.numel() * recall.element_size()
        path, lines = RT.policy.memo[3]
        assert path == "sparse" and all(torch.equal(a, b) for a, b in zip(lines, replayed._cache["lines"]))
        for t in lines[:2]:
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        assert lines[2] is rows  # a tensor with memory of its own is kept as it is (plans test the rows by identity)
    finally:
        RT.drain()
        RT.policy.memo.pop(3, None)


def test_every_kind_of_tensor_packs_in_one_buffer_and_comes_back():
    """Bool, 0-dim, empty, odd-sized and non-contiguous tensors (packed by one concatenation with filler between
    them) come back equal, with their dtypes and shapes; a kept tensor takes no room in the buffer."""
    wide = torch.arange(24, dtype=torch.int64).reshape(4, 6)
    kept = torch.arange(1000, dtype=torch.int32)
    tree = {"mask": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
            "odd": torch.arange(7, dtype=torch.int16), "view": wide.t(), "kept": kept,
            "half": torch.linspace(0, 1, 5, dtype=torch.bfloat16)}
    packed = PackedTree(tree, keep=(kept,))
    assert packed.flat.numel() < kept.numel() * kept.element_size()
    out = packed.unpack()
    assert out["kept"] is kept and same_tree(out, tree)
    for name, t in tree.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape and torch.equal(out[name], t), name

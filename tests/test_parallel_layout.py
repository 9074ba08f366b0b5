"""Sequence layouts: which positions each rank holds, shard/unshard round trips, the bad-length error."""

from __future__ import annotations

import pytest
import torch

from mtrain.parallel import LAYOUT_NAMES, Layout, LayoutError


def test_known_assignments():
    # hand-written for S = 16, W = 4 (block-stripe G = 2)
    expected = {
        "contiguous": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        "zigzag": [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]],
        "stripe": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
        "block-stripe": [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]],
    }
    for name, ranks in expected.items():
        layout = Layout.create(name, world_size=4, granularity=2)
        assert [layout.indices(16, r).tolist() for r in range(4)] == ranks, name


@pytest.mark.parametrize("name", LAYOUT_NAMES)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shard_unshard_round_trip(name, world):
    layout = Layout.create(name, world_size=world, granularity=4)
    seq_len = layout.length_multiple() * 3
    x = torch.randn(2, seq_len, 3)
    shards = [layout.shard(x, r) for r in range(world)]
    assert all(s.shape == (2, seq_len // world, 3) for s in shards)
    assert torch.equal(layout.unshard(shards), x)
    # every position is held exactly once, and shard() follows indices()
    held = torch.cat([layout.indices(seq_len, r) for r in range(world)])
    assert torch.equal(held.sort().values, torch.arange(seq_len))
    assert torch.equal(shards[world - 1], x[:, layout.indices(seq_len, world - 1)])
    # other dims work too
    y = torch.randn(seq_len, 5)
    assert torch.equal(layout.unshard([layout.shard(y, r, dim=0) for r in range(world)], dim=0), y)


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_owners_invert_indices(name):
    layout = Layout.create(name, world_size=4, granularity=8)
    owner, local = layout.owners(128)
    for r in range(4):
        pos = layout.indices(128, r)
        assert torch.equal(owner[pos], torch.full_like(pos, r))
        assert torch.equal(local[pos], torch.arange(pos.numel()))


@pytest.mark.parametrize("name", LAYOUT_NAMES)
@pytest.mark.parametrize("world,granularity,block", [(2, 16, 16), (4, 8, 16), (4, 32, 16), (8, 16, 64), (3, 16, 16)])
def test_local_blocks_lie_in_one_global_block(name, world, granularity, block):
    layout = Layout.create(name, world_size=world, granularity=granularity)
    seq_len = layout.length_multiple() * 8
    lb = layout.local_block_size(seq_len, block)
    assert (seq_len // world) % lb == 0
    for r in range(world):
        blocks = layout.indices(seq_len, r).view(-1, lb) // block
        assert torch.equal(blocks, blocks[:, :1].expand_as(blocks)), (name, r, lb)
    if name == "block-stripe" and granularity % block == 0:
        assert lb == block  # stripes of whole blocks keep the kernel's full block size


@pytest.mark.parametrize(
    "name,world,bad,needs",
    [("zigzag", 4, 12, "multiple of 8"), ("block-stripe", 4, 96, "multiple of 256"),
     ("contiguous", 3, 10, "multiple of 3"), ("stripe", 8, 4, "multiple of 8")],
)
def test_bad_length_error_says_what_works(name, world, bad, needs):
    layout = Layout.create(name, world_size=world, granularity=64)
    with pytest.raises(LayoutError, match=needs):
        layout.indices(bad, 0)
    with pytest.raises(LayoutError, match="pad the sequence"):
        layout.shard(torch.zeros(1, bad), 0)


def test_unknown_layout_and_rank():
    with pytest.raises(LayoutError, match="choose one of"):
        Layout.create("diagonal", world_size=2)
    with pytest.raises(LayoutError, match="outside world_size"):
        Layout.create("zigzag", world_size=2).indices(8, 2)


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_node_aware_layout_places_a_nodes_shards_apart(name):
    # 2 nodes of 4 ranks: rank = node * 4 + local holds slot local * 2 + node
    layout = Layout.create(name, world_size=8, granularity=4, local_world_size=4)
    plain = Layout.create(name, world_size=8, granularity=4)
    seq_len = plain.length_multiple() * 2
    for rank in range(8):
        node, local = divmod(rank, 4)
        assert torch.equal(layout.indices(seq_len, rank), plain.indices(seq_len, local * 2 + node))
    x = torch.randn(1, seq_len)
    assert torch.equal(layout.unshard([layout.shard(x, r) for r in range(8)]), x)
    owner, local_idx = layout.owners(seq_len)
    for rank in range(8):
        pos = layout.indices(seq_len, rank)
        assert torch.equal(owner[pos], torch.full_like(pos, rank))
    with pytest.raises(LayoutError, match="must divide world_size"):
        Layout.create(name, world_size=8, local_world_size=3)

"""Trainer building blocks against independent references: LR schedule, chunked loss, document mask."""

import math

import pytest
import torch
import torch.nn.functional as F

from mtrain.train.loss import chunked_lm_loss
from mtrain.train.schedule import lr_factor
from mtrain.train.trainer import document_mask


def test_cosine_schedule_shape():
    total, warm = 100, 10
    f = [lr_factor(s, total, schedule="cosine", warmup=warm, min_ratio=0.1) for s in range(total)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(f[:10], f[1:10]))  # warmup rises
    assert all(a >= b for a, b in zip(f[10:], f[11:]))  # then decays monotonically
    mid = 10 + 45
    assert f[mid] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(total, total, schedule="cosine", warmup=warm, min_ratio=0.1) == pytest.approx(0.1)


def test_rewarm_starts_from_floor():
    f0 = lr_factor(0, 50, schedule="rewarm", warmup=5, min_ratio=0.2, start_ratio=0.2)
    assert f0 == pytest.approx(0.2 + 0.8 / 5)
    assert lr_factor(4, 50, schedule="rewarm", warmup=5, min_ratio=0.2, start_ratio=0.2) == pytest.approx(1.0)


@pytest.mark.parametrize("chunk", [3, 7, 64])
def test_chunked_loss_matches_full_cross_entropy(chunk):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).double()
    hidden = torch.randn(2, 11, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (2, 11))
    labels[0, 3] = labels[1, -1] = -100
    total, count = chunked_lm_loss(hidden, head, labels, chunk=chunk)
    ref = F.cross_entropy(head(hidden).reshape(-1, 50), labels.reshape(-1), ignore_index=-100, reduction="sum")
    assert int(count) == 20
    assert torch.allclose(total.double(), ref, rtol=1e-6)
    g1 = torch.autograd.grad(total, [hidden, head.weight])
    g2 = torch.autograd.grad(ref, [hidden, head.weight])
    for a, b in zip(g1, g2):
        assert torch.allclose(a.double(), b, rtol=1e-5, atol=1e-7)


def test_chunked_loss_reads_the_chunks_labels_back_once():
    """Which chunks hold a label is read back in one host read for all chunks, not one per chunk (each a wait for
    the device between the forward and the backward on a GPU); a chunk with no label (all -100) still adds nothing."""
    from syncs import CountSyncs, count_tolist

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).double()
    hidden = torch.randn(1, 40, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (1, 40))
    labels[0, 8:16] = -100  # the second chunk of 8 holds no label
    mode = CountSyncs()
    with count_tolist() as reads, mode:
        total, count = chunked_lm_loss(hidden, head, labels, chunk=8)
    assert not mode.sites, dict(mode.sites)
    assert len(reads) == 1 and "chunked_lm_loss" in reads[0], reads
    ref = F.cross_entropy(head(hidden).reshape(-1, 50), labels.reshape(-1), ignore_index=-100, reduction="sum")
    assert int(count) == 32
    assert torch.allclose(total.double(), ref, rtol=1e-6)


def test_document_mask_blocks_cross_document_attention():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    m = document_mask(pos)[0, 0]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for q, k in [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (3, 3), (4, 3), (4, 4), (5, 5)]:
        expected[q, k] = True
    assert torch.equal(m, expected)

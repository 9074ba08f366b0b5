"""TrainingReader: labels / position_ids / spans against a loop reference, DP/CP sharding, the cursor, and
reading ProLong-schema MDS (zstd) directly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mtrain.data import TrainingReader, pack, sample_to_tensors
from mtrain.errors import MtrainError
from test_data_pack import make_docs, make_tokenizer, write_prolong_mds


def reference(ids: list[int], spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Labels and position ids by a plain loop over the documents."""
    labels, positions = [], []
    for start, end in spans:
        for i in range(start, end):
            labels.append(ids[i + 1] if i + 1 < end else -100)
            positions.append(i - start)
    return labels, positions


@pytest.mark.parametrize("seed", range(5))
def test_sample_tensors_match_loop_reference(seed):
    rng = np.random.default_rng(seed)
    seq = int(rng.integers(8, 200))
    cuts = sorted(set(rng.integers(1, seq, size=int(rng.integers(0, 6))).tolist()))
    edges = [0, *cuts, seq]
    spans = list(zip(edges[:-1], edges[1:]))
    ids = rng.integers(0, 1000, size=seq).astype(np.uint32)
    out = sample_to_tensors(ids, np.array(spans, dtype=np.uint32), document_masking=True)
    labels, positions = reference(ids.tolist(), spans)
    assert out["input_ids"].dtype == torch.long and out["input_ids"].tolist() == ids.tolist()
    assert out["labels"].tolist() == labels
    assert out["position_ids"].tolist() == positions
    assert out["doc_spans"].tolist() == [list(s) for s in spans]
    flat = sample_to_tensors(ids, np.array(spans, dtype=np.uint32), document_masking=False)
    labels, positions = reference(ids.tolist(), [(0, seq)])
    assert flat["labels"].tolist() == labels and flat["position_ids"].tolist() == list(range(seq))
    assert flat["doc_spans"].tolist() == [[0, seq]]


def test_uncovered_tokens_become_their_own_document():
    out = sample_to_tensors(np.arange(10), np.array([[2, 5], [5, 8]]), document_masking=True)
    assert out["doc_spans"].tolist() == [[0, 2], [2, 5], [5, 8], [8, 10]]
    assert out["position_ids"].tolist() == [0, 1, 0, 1, 2, 0, 1, 2, 0, 1]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("reader")
    make_tokenizer(root / "tok", 300, llama_like=False)
    with open(root / "docs.jsonl", "w") as fh:
        for text in make_docs(200, seed=11):
            fh.write(json.dumps({"text": text}) + "\n")
    out = root / "packed"
    manifest = pack([str(root / "docs.jsonl")], str(root / "tok"), 64, str(out), samples_per_shard=8,
                    workers=1, progress=False)
    assert manifest["num_samples"] >= 40
    return out, manifest


def test_dp_ranks_disjoint_and_cp_ranks_identical(dataset):
    out, manifest = dataset
    dp = 3
    readers = [TrainingReader(out, dp_rank=r, dp_size=dp, seed=5) for r in range(dp)]
    orders = [set(r.epoch_order(0).tolist()) for r in readers]
    assert all(len(o) == len(readers[0]) == manifest["num_samples"] // dp for o in orders)
    assert not (orders[0] & orders[1]) and not (orders[1] & orders[2]) and not (orders[0] & orders[2])
    # two CP ranks of DP group 1 read the same tensors
    cp_a, cp_b = TrainingReader(out, dp_rank=1, dp_size=dp, seed=5), TrainingReader(out, dp_rank=1, dp_size=dp, seed=5)
    for a, b in zip(cp_a, cp_b):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert cp_a.epoch == 1 and cp_a.position == 0
    # a new epoch reshuffles; shuffle=False reads in stored order
    assert readers[0].epoch_order(1).tolist() != readers[0].epoch_order(0).tolist()
    plain = TrainingReader(out, shuffle=False)
    assert plain.epoch_order(0).tolist() == list(range(manifest["num_samples"]))
    assert plain.seq_len == 64 == len(plain.sample(0)["input_ids"])


def test_cursor_restores_exactly_and_refuses_mismatch(dataset):
    out, _ = dataset
    first = TrainingReader(out, dp_rank=0, dp_size=2, seed=1)
    n = len(first)
    stream = []
    for _ in range(2):  # two epochs
        stream.extend(x["input_ids"] for x in first)
    resumed_from = n - 3  # restore 3 samples before an epoch boundary
    again = TrainingReader(out, dp_rank=0, dp_size=2, seed=1)
    it = iter(again)
    for _ in range(resumed_from):
        next(it)
    state = again.state_dict()
    restored = TrainingReader(out, dp_rank=0, dp_size=2, seed=1)
    restored.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    tail = [x["input_ids"] for x in restored] + [x["input_ids"] for x in restored]
    assert all(torch.equal(a, b) for a, b in zip(tail, stream[resumed_from:]))
    assert len(tail) == 2 * n - resumed_from
    with pytest.raises(MtrainError, match="dp_size=2 but this run has dp_size=4"):
        TrainingReader(out, dp_rank=0, dp_size=4, seed=1).load_state_dict(state)
    with pytest.raises(MtrainError, match="seed"):
        TrainingReader(out, dp_rank=0, dp_size=2, seed=2).load_state_dict(state)


def test_reads_prolong_schema_zstd_mds_directly(tmp_path):
    tok = make_tokenizer(tmp_path / "tok", 300, llama_like=True)
    docs = make_docs(40, seed=4)
    write_prolong_mds(tmp_path / "prolong", docs, tok, 256, "web", compression="zstd", split=True)
    reader = TrainingReader(tmp_path / "prolong", shuffle=False)
    assert reader.seq_len == 256
    stream = []
    for x in reader:
        spans = x["doc_spans"].tolist()
        ids = x["input_ids"].tolist()
        labels, positions = reference(ids, [tuple(s) for s in spans])
        assert x["labels"].tolist() == labels and x["position_ids"].tolist() == positions
        stream.extend(ids)
    expected = [t for text in docs for t in tok(text)["input_ids"] + [tok.eos_token_id]]
    assert stream == expected


def test_reader_rejects_bad_rank(dataset):
    out, _ = dataset
    with pytest.raises(MtrainError, match="dp_rank 2"):
        TrainingReader(out, dp_rank=2, dp_size=2)

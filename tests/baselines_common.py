"""Shared by the baseline-kind tests (moba, xattention, ulysses): independent float64 references with each kind's
mask built from its definition (plain loops over blocks, tiny shapes), and one gloo worker that runs a kind under
CP on every layout it supports and records its errors against those references."""

from __future__ import annotations

import json
import math
import os

import torch
import torch.distributed as dist

SEQ, BLOCK, HQ, HKV, DIM = 256, 16, 4, 2, 16
OUT_TOL, GRAD_TOL = 1e-5, 1e-4  # fp32 op against the float64 reference (the ring tests' tolerances)
MOBA = dict(chunk_size=64, topk=1)
XATTN = dict(stride=4, threshold=0.6)


def inputs(batch: int = 2, seed: int = 7, seq: int = SEQ):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, HQ, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(batch, seq, HKV, DIM, generator=g, dtype=torch.float64)
    v = torch.randn(batch, seq, HKV, DIM, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, seq, HQ, DIM, generator=g, dtype=torch.float64)
    return q, k, v, dout


def make_docs(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    """Packed documents with boundaries mid-block and mid-shard (and a one-token document)."""
    docs = torch.zeros(batch, seq, dtype=torch.long)
    for start in (0, 37, 38, 100, 171, 230):
        docs[:, start:] += 1
    return docs


def reference_attention(q, k, v, mask, scale):
    """softmax(scale q k^T) v in float64 over the pairs of `mask` [B, Hq, S, S] (GQA by repeating K/V)."""
    g = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(g, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(g, dim=1)
    scores = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vh).transpose(1, 2)


def causal_mask(batch: int, seq: int) -> torch.Tensor:
    return torch.ones(seq, seq, dtype=torch.bool).tril().expand(batch, HQ, seq, seq).clone()


def moba_mask(q, k, block_size: int, chunk_size: int, topk: int) -> torch.Tensor:
    """MoBA from its definition: per query block, its mean query against each earlier chunk's mean key; keep the
    top-k chunks (whole) and the own chunk up to the diagonal (causal)."""
    B, S, Hq, _ = q.shape
    g = Hq // k.shape[2]
    mask = torch.zeros(B, Hq, S, S, dtype=torch.bool)
    for b in range(B):
        for h in range(Hq):
            for i0 in range(0, S, block_size):
                i1 = min(S, i0 + block_size)
                qm = q[b, i0:i1, h].double().mean(0)
                own = i0 // chunk_size
                scores = [float(qm @ k[b, c * chunk_size:(c + 1) * chunk_size, h // g].double().mean(0))
                          for c in range(own)]
                best = sorted(range(own), key=lambda c: -scores[c])[:topk]
                for c in best:
                    mask[b, h, i0:i1, c * chunk_size:(c + 1) * chunk_size] = True
                mask[b, h, i0:i1, own * chunk_size:i1] = True
    return mask & causal_mask(B, S)


def xattention_mask(q, k, block_size: int, stride: int, threshold: float, scale: float) -> torch.Tensor:
    """XAttention from its definition: strided antidiagonal means of the logits, a softmax per query group over the
    earlier key groups, block sums normalised per query block; keep the diagonal and first blocks, then the best
    blocks while the mass kept so far is below threshold x the row's total."""
    B, S, Hq, _ = q.shape
    g = Hq // k.shape[2]
    n_groups, per = S // stride, block_size // stride
    logits = torch.einsum("bshd,bthd->bhst", q.double(), k.double().repeat_interleave(g, dim=2)) * scale
    m = torch.arange(n_groups)
    strided = sum(logits[:, :, m * stride + stride - 1 - t][:, :, :, m * stride + t] for t in range(stride)) / stride
    earlier = m[None, :] < m[:, None]
    probs = torch.softmax(strided.masked_fill(~earlier, float("-inf")), -1).nan_to_num(0.0)
    nb = -(-S // block_size)
    mask = torch.zeros(B, Hq, S, S, dtype=torch.bool)
    for b in range(B):
        for h in range(Hq):
            for i in range(nb):
                score = [float(probs[b, h, i * per:(i + 1) * per, j * per:(j + 1) * per].sum()) for j in range(i + 1)]
                total = sum(score)
                score = [s / total if total > 0 else 0.0 for s in score]
                kept = sorted({0, i})
                mass = sum(score[j] for j in kept)
                for j in sorted((j for j in range(i + 1) if j not in kept), key=lambda j: -score[j]):
                    if mass >= threshold * sum(score):
                        break
                    kept.append(j)
                    mass += score[j]
                for j in kept:
                    mask[b, h, i * block_size:(i + 1) * block_size, j * block_size:(j + 1) * block_size] = True
    return mask & causal_mask(B, S)


def kind_mask(kind: str, q, k, scale: float) -> torch.Tensor:
    if kind == "moba":
        return moba_mask(q, k, BLOCK, MOBA["chunk_size"], MOBA["topk"])
    if kind == "xattention":
        return xattention_mask(q, k, BLOCK, XATTN["stride"], XATTN["threshold"], scale)
    return causal_mask(q.shape[0], q.shape[1])


def _reference_grads(kind: str, q, k, v, dout, scale, doc_ids):
    """The kind's reference attention on the whole sequence under its mask (selected on the same fp32 values the
    method sees; same-document pairs only with doc_ids) and its backward: (out, [q, k, v] holding their grads)."""
    mask = kind_mask(kind, q.float(), k.float(), scale)
    if doc_ids is not None:
        mask &= (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = reference_attention(*full, mask, scale)
    ref.backward(dout)
    return ref, full


def _max_err(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def _cp_case(rank, world, kind, layout_name, docs, results):
    from mtrain.parallel import Layout, ring_attention
    from mtrain.parallel.selection import moba_rank_index, xattention_rank_index
    from mtrain.parallel.ulysses import ulysses_attention

    q, k, v, dout = inputs()
    scale = 1.0 / math.sqrt(DIM)
    doc_ids = make_docs() if docs else None
    layout = Layout.create(layout_name, world_size=world, granularity=BLOCK)
    shards = [layout.shard(t.float(), rank).requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
    record = {}
    if kind == "ulysses":
        out = ulysses_attention(*shards[:3], group=None, layout=layout, doc_ids=doc_ids)
    else:
        if kind == "moba":
            index = moba_rank_index(shards[0].detach(), shards[1].detach(), layout, rank, None, block_size=BLOCK,
                                    **MOBA)
        else:
            index = xattention_rank_index(shards[0].detach(), shards[1].detach(), layout, rank, None, scale=scale,
                                          block_size=BLOCK, **XATTN)
        record["density"] = index.density()
        out = ring_attention(*shards[:3], group=None, layout=layout, index=index, doc_ids=doc_ids)
    out.backward(shards[3])
    ref, full = _reference_grads(kind, q, k, v, dout, scale, doc_ids)
    record["out"] = _max_err(out.detach(), layout.shard(ref.detach(), rank))
    for name, got, want in zip(("dq", "dk", "dv"), shards[:3], full):
        record[name] = _max_err(got.grad, layout.shard(want.grad, rank))
    if kind != "ulysses":  # the selection must matter, or the case proves nothing
        dense = reference_attention(q, k, v, causal_mask(q.shape[0], SEQ), scale)
        record["gap_to_dense"] = _max_err(out.detach(), layout.shard(dense, rank))
    results[f"{world}/{layout_name}/{'docs' if docs else 'plain'}"] = record


def cp_worker(rank, world, init_file, out_dir, kind):
    """run_ranks target: every (layout, documents) case of `kind` on this rank; writes rank{N}.json."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    for layout_name in ("zigzag", "block-stripe"):
        for docs in (False, True):
            _cp_case(rank, world, kind, layout_name, docs, results)
    if kind == "ulysses":  # a head split the group cannot make is refused when the attention runs
        from mtrain.errors import MtrainError
        from mtrain.parallel import Layout
        from mtrain.parallel.ulysses import ulysses_attention

        q = torch.randn(1, SEQ // world, 6, DIM)
        kv = torch.randn(1, SEQ // world, 3, DIM)
        try:
            ulysses_attention(q, kv, kv, group=None, layout=Layout.create("zigzag", world_size=world))
            results["bad-heads"] = None
        except MtrainError as err:
            results["bad-heads"] = str(err)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def run_cp(kind: str, tmp_path_factory) -> dict:
    """{case: [record per rank]} for CP 2 and 4 (one spawned gloo group each)."""
    from ranks import run_ranks

    results: dict = {}
    for world in (2, 4):
        out_dir = tmp_path_factory.mktemp(f"{kind}{world}")
        run_ranks(cp_worker, world, (world, str(out_dir / "init"), str(out_dir), kind))
        for rank in range(world):
            with open(out_dir / f"rank{rank}.json") as f:
                for case, record in json.load(f).items():
                    results.setdefault(case, []).append(record)
    return results


CP_CASES = [f"{w}/{layout}/{docs}" for w in (2, 4) for layout in ("zigzag", "block-stripe") for docs in ("plain", "docs")]


def check_cp_case(results: dict, case: str) -> None:
    records = results[case]
    world = int(case.split("/")[0])
    assert len(records) == world, f"{case}: {len(records)} of {world} ranks reported"
    for rank, r in enumerate(records):
        assert r["out"] < OUT_TOL, f"{case} rank {rank}: out differs by {r['out']:.2e}"
        for name in ("dq", "dk", "dv"):
            assert r[name] < GRAD_TOL, f"{case} rank {rank}: {name} differs by {r[name]:.2e}"
        if "density" in r:
            assert r["density"] < 0.9, f"{case}: the selection kept nearly everything; the test is too weak"
    if "gap_to_dense" in records[0]:
        assert max(r["gap_to_dense"] for r in records) > 1e-2, f"{case}: output equals dense attention"


def single_device_errors(kind: str, docs: bool, seq: int = SEQ) -> dict:
    """The one-device op (fp32) against the float64 reference: errors of out, dq, dk, dv, and the index density."""
    from mtrain.ops.moba import moba_attention
    from mtrain.ops.xattention import xattention_attention

    q, k, v, dout = inputs(seq=seq)
    scale = 1.0 / math.sqrt(DIM)
    doc_ids = make_docs(seq=seq) if docs else None
    ours = [t.float().requires_grad_(True) for t in (q, k, v)]
    if kind == "moba":
        out, index = moba_attention(*ours, block_size=BLOCK, doc_ids=doc_ids, return_index=True, **MOBA)
    else:
        out, index = xattention_attention(*ours, block_size=BLOCK, doc_ids=doc_ids, return_index=True, **XATTN)
    out.backward(dout.float())
    ref, full = _reference_grads(kind, q, k, v, dout, scale, doc_ids)
    dense = reference_attention(q, k, v, causal_mask(q.shape[0], seq), scale)
    errors = {"out": _max_err(out.detach(), ref.detach()), "density": index.density(),
              "gap_to_dense": _max_err(out.detach(), dense)}
    for name, got, want in zip(("dq", "dk", "dv"), ours, full):
        errors[name] = _max_err(got.grad, want.grad)
    return errors


def load_kind(kind: str, tmp_path, *overrides: str):
    """The tiny model's recipe with attention.kind `kind` and `overrides`, loaded (and so checked) as `mtrain
    train` loads it; data.path is a stand-in packed folder under tmp_path."""
    from mtrain.config import load_recipe

    (tmp_path / "packed").mkdir(exist_ok=True)
    (tmp_path / "packed" / "index.json").write_text("{}")
    return load_recipe(None, ["model.config=mtrain/assets/tiny-qwen2/config.json",
                              "model.tokenizer=mtrain/assets/tiny-tokenizer", f"data.path={tmp_path / 'packed'}",
                              f"attention.kind={kind}", *overrides])


def train_steps(kind: str, tmp_path, *overrides: str) -> list[dict]:
    """Two optimizer steps of the tiny model with attention.kind `kind` through the trainer (in-process, one rank,
    packed synthetic documents of 256 tokens); returns the metrics rows."""
    import yaml

    from mtrain.config import load_recipe
    from mtrain.data import pack
    from mtrain.data.synthetic import CorpusSpec, generate, write_jsonl
    from mtrain.tiny import MODEL_CONFIG, TOKENIZER_DIR
    from mtrain.train.trainer import Trainer

    write_jsonl(tmp_path / "docs.jsonl", generate(CorpusSpec(num_docs=30, max_sentences=40, seed=5)))
    pack([f"{tmp_path / 'docs.jsonl'}:jsonl"], str(TOKENIZER_DIR), 256, tmp_path / "packed", progress=False, workers=1)
    recipe = {
        "model": {"config": str(MODEL_CONFIG), "tokenizer": str(TOKENIZER_DIR)},
        "data": {"path": str(tmp_path / "packed"), "seq_len": 256},
        "attention": {"kind": kind, "block_size": 32},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "logging": {"wandb": "disabled"},
        "train": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "save_every": 0, "export": False},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    Trainer(load_recipe(tmp_path / "recipe.yaml", list(overrides))).run()
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]

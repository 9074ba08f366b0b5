"""GPU correctness gate: every attention engine x dtype x block size x GQA x document masking against a float64
reference, on short ragged sequences. Exits non-zero on any failure. Run it in every GPU session before timing:

    mtrain bench check            # on the GPU machine (each case in its own process: compiles dominate)
    TRITON_INTERPRET=1 mtrain bench check --device cpu --quick   # smoke on a CPU (fp32/fp16 only)

Engines: mtrain's Triton kernels with the deterministic and the atomic backward, FlexAttention driven by the same
index (CUDA only), the ring's partial entry point on a shard with global positions (block-stripe: the query shard
of rank 1 of 2 against rank 0's keys), and dense attention (the fastest backend; with documents, our kernels).
Flex runs at 128-token blocks only (its 64-token backward lowers only under max_autotune, minutes per shape).
FlashAttention-4 as the block engine (impl="fa4", CUDA, fp16/bf16, 128-token blocks, when flash_attn.cute is
importable; otherwise one "skip" line): "fa4" with FA4's own block-sparse backward (deterministic=False), "fa4-det"
with our deterministic backward behind FA4's forward, and "fa4-nocols" on the same slashes without verticals (no
column path, FA4 alone). "triton-listfree", "triton-lf-atomic" and "fa4-listfree": the same index with its columns
read list-free (`mtrain.ops.columns.VerticalColumns`), against the same reference.
With documents, "dense-fa4" / "dense-sdpa" / "dense-triton" run dense attention within the documents through each
varlen backend (`mtrain.ops.varlen`; fa4 where FA4 runs), and every case runs "ring-dense": the dense ring's gathered
step (`mtrain.parallel.dense_gather`, zigzag) of rank 0 of a 2-rank group run alone (`mtrain.bench.emulate`), against
float64 attention with the other rank's keys zeroed.
Tolerances are relative Frobenius errors against float64, per dtype (TOL below), on out and dq/dk/dv.
The pattern estimator's Triton scorer is checked in each case too: its est_recall against the float64 mass of
the scored rows inside its index, its density against the PyTorch scorer's. On CUDA two ring cases run on a
one-rank process group: "ring-fa4", `ring_attention` with the fa4 engine (FA4 steps, our column path; our kernels
where FA4 cannot run), "ring-listfree", the same on a rank index without column lists (the ring's columns read
list-free, `mtrain.ops.columns.RingColumns`), and "ring-estimate", the distributed Triton estimate giving the
single-device lines.
"merge" checks the ring's running LSE merge (fused Triton and torch) against float64 on CUDA, and the gathered
schedule's one-pass sum of the ranks' dK/dV parts against the sum in rank order, bit for bit. "repeat" runs the
deterministic engines (triton-det, fa4-det, the ring on a one-rank group) twice under
torch.use_deterministic_algorithms(True) and fails unless out and every gradient are bitwise equal; the atomic
backwards (triton-atomic, fa4) run twice too, labelled atomic, their differences reported but not failed.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time

import torch

from mtrain.ops import SparseIndex, dense_attention, partial, reference, vertical_slash_attention  # noqa: E402
from mtrain.ops.columns import with_list_free_columns  # noqa: E402
from mtrain.ops.partial_autograd import partial_attention  # noqa: E402

# dtype -> largest relative error allowed (out, grads): accumulation is fp32, so the input rounding dominates.
TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 5e-3), torch.bfloat16: (1.5e-2, 3e-2)}


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def make_case(S, Hq, Hkv, D, bs, dtype, docs: bool, device, seed, columns: bool = True):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(1, S, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    vertical = torch.randint(0, S, (1, Hq, 6), generator=g).to(device)
    if not columns:  # same slashes (drawn after the verticals), no vertical columns
        vertical = vertical[..., :0]
    slash = torch.cat([torch.zeros(1, Hq, 1, dtype=torch.long), torch.randint(1, S, (1, Hq, 3), generator=g)], -1)
    index = SparseIndex.from_lines(vertical, slash.to(device), S, bs)
    index._cache["lines"] = (vertical, slash.to(device))  # as the estimator keeps them: the list-free form's source
    doc_ids = None
    if docs:  # three documents of uneven length
        cuts = torch.tensor([0, S // 3 + 7, (2 * S) // 3 - 5, S])
        doc_ids = torch.repeat_interleave(torch.arange(3), cuts.diff()).to(device)[None]
    return q, k, v, index, doc_ids


def reference_grads(q, k, v, mask, dout):
    qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out, _ = reference.attention(qr, kr, vr, mask)
    out.backward(dout.double())
    return out.detach(), qr.grad, kr.grad, vr.grad


def engine_grads(fn, q, k, v, dout):
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(qq, kk, vv)
    out.backward(dout)
    return out.detach(), qq.grad, kk.grad, vv.grad


_FA4: dict = {}


def fa4_importable() -> bool:
    """Whether FlashAttention-4's CuTe kernels import here (once per process)."""
    if "ok" not in _FA4:
        try:
            from mtrain.ops.fa4 import load_fa4

            load_fa4()
            _FA4["ok"] = True
        except ImportError:
            _FA4["ok"] = False
    return _FA4["ok"]


def fa4_eligible(device, index, dtype) -> bool:
    return (device.type == "cuda" and index.block_size == 128 and dtype in (torch.float16, torch.bfloat16)
            and fa4_importable())


def engines(device, index, doc_ids, S, dtype=None):
    out = {
        "triton-det": lambda q, k, v: vertical_slash_attention(q, k, v, index, impl="triton", doc_ids=doc_ids),
        "triton-atomic": lambda q, k, v: vertical_slash_attention(q, k, v, index, impl="triton", deterministic=False,
                                                                   doc_ids=doc_ids),
        "dense": lambda q, k, v: dense_attention(q, k, v, causal=True, doc_ids=doc_ids),
    }
    if doc_ids is not None:  # dense attention with documents through each varlen backend that runs here
        from mtrain.ops.dense import fa4_runs
        from mtrain.ops.varlen import Documents, document_attention

        docs = Documents.from_doc_ids(doc_ids)
        for backend in ("fa4", "sdpa", "triton"):
            if backend != "fa4" or (dtype is not None and fa4_runs(torch.empty(1, 1, 1, 64, device=device,
                                                                               dtype=dtype))):
                out[f"dense-{backend}"] = (lambda b: lambda q, k, v: document_attention(q, k, v, docs,
                                                                                        backend=b))(backend)
    # the same index with its columns read list-free (mtrain.ops.columns): the same pairs, so the same reference
    listfree = with_list_free_columns(index)
    out["triton-listfree"] = lambda q, k, v: vertical_slash_attention(q, k, v, listfree, impl="triton",
                                                                      doc_ids=doc_ids)
    out["triton-lf-atomic"] = lambda q, k, v: vertical_slash_attention(q, k, v, listfree, impl="triton",
                                                                       deterministic=False, doc_ids=doc_ids)
    if device.type == "cuda" and index.block_size >= 128:  # Flex lowers 64-blocks only under max_autotune
        out["flex"] = lambda q, k, v: vertical_slash_attention(q, k, v, index, impl="flex", doc_ids=doc_ids)
    if fa4_eligible(device, index, dtype):
        out["fa4"] = lambda q, k, v: vertical_slash_attention(q, k, v, index, impl="fa4", deterministic=False,
                                                              doc_ids=doc_ids)
        out["fa4-det"] = lambda q, k, v: vertical_slash_attention(q, k, v, index, impl="fa4", doc_ids=doc_ids)
        out["fa4-listfree"] = lambda q, k, v: vertical_slash_attention(q, k, v, listfree, impl="fa4",
                                                                       deterministic=False, doc_ids=doc_ids)
    return out


def ring_step_case(q, k, v, index, doc_ids, bs, dout):
    """Rank 1 of a 2-rank block-stripe ring: its query stripes against rank 0's key stripes (global positions)."""
    S = q.shape[1]
    stripes = torch.arange(S, device=q.device) // bs
    mine, theirs = (stripes % 2 == 1).nonzero().flatten(), (stripes % 2 == 0).nonzero().flatten()
    qs, ks, vs = q[:, mine], k[:, theirs], v[:, theirs]
    # a sparse step: query block i lists the key blocks j of the other shard with (i + j) % 3 != 1
    nqb, nkb, H = -(-mine.numel() // bs), -(-theirs.numel() // bs), q.shape[2]
    i, j = torch.arange(nqb, device=q.device)[:, None], torch.arange(nkb, device=q.device)[None, :]
    keep = ((i + j) % 3 != 1).expand(1, H, nqb, nkb)
    ids = torch.where(keep, j.expand_as(keep), nkb).sort(-1).values
    blocks = (torch.where(ids < nkb, ids, -1).to(torch.int32).contiguous(), keep.sum(-1).to(torch.int32))
    q_doc = None if doc_ids is None else doc_ids[:, mine]
    k_doc = None if doc_ids is None else doc_ids[:, theirs]
    full = reference.partial_mask(mine, theirs, batch=1, heads=H, blocks=blocks, columns=None, block_size=bs,
                                  causal=True, q_doc=q_doc, k_doc=k_doc)
    want = reference_grads(qs, ks, vs, full, dout[:, mine])

    def fn(a, b, c):
        return partial_attention(a, b, c, q_pos=mine, k_pos=theirs, blocks=blocks, block_size=bs, causal=True,
                                 impl="triton", q_doc=q_doc, k_doc=k_doc)[0]

    return want, engine_grads(fn, qs, ks, vs, dout[:, mine])


def estimator_case(q, k, doc_ids, bs, tag) -> str:
    """The estimator's Triton scorer: its est_recall against the float64 mass of the scored rows inside its own
    index, and its density against the PyTorch scorer's (same rows, float32 probabilities)."""
    from mtrain.ops.estimate import estimate_vertical_slash, scored_rows
    from mtrain.ops.recall import true_recall

    kw = dict(recall=0.9, last_q=64, sample_blocks=4, block_size=bs, doc_ids=doc_ids)
    got = estimate_vertical_slash(q, k, scorer="triton", **kw)
    ref = estimate_vertical_slash(q, k, scorer="torch", **kw)
    rows = scored_rows(q.shape[1], 64, 4, bs)
    want = true_recall(q.double(), k.double(), got, doc_ids=doc_ids, rows=rows).double()  # float64 on float64
    err = float((got._cache["est_recall"].double() - want).abs().max())
    d_err = abs(got.density() - ref.density())
    bad = err > 2e-3 or d_err > 0.03 or not math.isfinite(err)
    return (f"{'FAIL' if bad else 'ok  '} {'estimator':13s} {tag} density={got.density():.2f}: est_recall vs f64 "
            f"{err:.1e} (tol 2e-3), density vs torch scorer {d_err:.1e} (tol 0.03)")


def _one_rank_group(device) -> None:
    """A process group of this process alone (NCCL on CUDA, gloo on the CPU) for the ring cases, made once."""
    import tempfile

    import torch.distributed as dist

    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(), "init")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}", rank=0,
                                world_size=1)


def dense_gather_case(q, k, v, doc_ids, dout, world: int = 2):
    """The dense ring's gathered step (`mtrain.parallel.dense_gather`, zigzag) for rank 0 of a `world`-rank group,
    run alone (`mtrain.bench.emulate`: the other ranks' keys are zeros); reference: float64 attention over the whole
    sequence with those keys zeroed, rank 0's rows, and the gradients of rank 0's rows alone (what its shard of dK/dV
    holds before the other ranks' parts are added). Returns (got, want), each (out, dq, dk, dv) of rank 0's shard."""
    from mtrain.bench.emulate import emulated_group
    from mtrain.ops.varlen import Documents
    from mtrain.parallel.dense_gather import gathered_dense_attention, query_runs
    from mtrain.parallel.layout import Layout

    S = q.shape[1]
    layout = Layout.create("zigzag", world_size=world)
    mine = layout.indices(S, 0).to(q.device)
    others = torch.ones(S, dtype=torch.bool, device=q.device)
    others[mine] = False
    k0, v0 = (t.masked_fill(others[None, :, None, None], 0) for t in (k, v))
    mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    if doc_ids is not None:
        mask &= doc_ids[0][:, None] == doc_ids[0][None, :]
    qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k0, v0))
    out, _ = reference.attention(qr, kr, vr, mask)
    out[:, mine].backward(dout[:, mine].double())
    want = (out.detach()[:, mine], qr.grad[:, mine], kr.grad[:, mine], vr.grad[:, mine])
    docs = None if doc_ids is None else Documents.from_doc_ids(doc_ids)
    shards = [t[:, mine].detach().clone().requires_grad_(True) for t in (q, k, v)]
    with emulated_group(world, 0) as grp:
        got = gathered_dense_attention(*shards, query_runs(layout, S, 0), layout, grp, q.shape[-1] ** -0.5, docs)
        got.backward(dout[:, mine])
    return (got.detach(), *(t.grad for t in shards)), want


def ring_engine_case(q, k, v, index, doc_ids, bs, dout):
    """`ring_attention` with engine="fa4" (FA4's block-sparse steps, the columns through ours; where FA4 cannot run it
    falls back to our kernels) on a one-rank ring: the local step's diagonal mask block and the gathered sink and
    vertical columns merged into FA4's result."""
    from mtrain.parallel import Layout, ring_attention

    _one_rank_group(q.device)
    layout = Layout.create("block-stripe", world_size=1, granularity=bs)
    return engine_grads(lambda a, b, c: ring_attention(a, b, c, layout=layout, index=index, engine="fa4",
                                                       doc_ids=doc_ids), q, k, v, dout)


def ring_list_free_case(q, k, v, index, doc_ids, bs, dout):
    """`ring_attention` (engine fa4: FA4's steps where it runs, our kernels elsewhere) on a one-rank ring whose
    rank index holds no column lists (`rows_from_lines(columns=False)`, as `estimate_rank_index` builds it at large
    caps): the off-ring columns read list-free (`mtrain.ops.columns.RingColumns`, the kernels' VCOLS 2)."""
    from mtrain.ops.index import rows_from_lines
    from mtrain.parallel import Layout, ring_attention

    _one_rank_group(q.device)
    vertical, slash = index._cache["lines"][:2]
    rows = torch.arange(index.n_blocks, device=q.device)
    mine = rows_from_lines(vertical, slash, q.shape[1], bs, rows, bound_widths=True, columns=False)
    mine._cache["lines"] = (vertical, slash, rows)
    layout = Layout.create("block-stripe", world_size=1, granularity=bs)
    return engine_grads(lambda a, b, c: ring_attention(a, b, c, layout=layout, index=mine, engine="fa4",
                                                       doc_ids=doc_ids), q, k, v, dout)


def ring_estimator_case(q, k, doc_ids, bs, tag) -> str:
    """The distributed estimate through the Triton scorer (`mtrain.parallel.estimate`, key blocks mapped) on a
    one-rank group gives the single-device estimator's lines, on the whole blocks of the case's sequence."""
    from mtrain.ops.estimate import estimate_vertical_slash
    from mtrain.parallel import SparseSettings
    from mtrain.parallel.estimate import estimate_index

    _one_rank_group(q.device)
    S = q.shape[1] // bs * bs
    q, k = q[:, :S], k[:, :S]
    docs = None if doc_ids is None else doc_ids[:, :S]
    kw = dict(block_size=bs, recall=0.95, sample_blocks=4)
    want = estimate_vertical_slash(q, k, doc_ids=docs, **kw)
    pos = torch.arange(S, device=q.device)
    got = estimate_index(q, k, pos, pos, S, SparseSettings(**kw), q.shape[-1] ** -0.5, None, doc_ids=docs,
                         scorer="triton", key_blocks=torch.arange(S // bs, device=q.device))
    same = all(torch.equal(getattr(got, f), getattr(want, f)) for f in ("block_ids", "block_counts", "col_ids",
                                                                          "col_counts"))
    err = float((got._cache["est_recall"] - want._cache["est_recall"]).abs().max())
    bad = not same or err > 1e-4
    return (f"{'FAIL' if bad else 'ok  '} {'ring-estimate':13s} {tag} density={want.density():.2f}: lines equal one "
            f"device's: {same}, est_recall diff {err:.1e} (tol 1e-4)")


def merge_case(device, dtype, tag) -> list[str]:
    """The ring's running LSE merge (`mtrain.parallel.merge.PartialAccumulator`: the first part taken as it came,
    fp32 in between, the last merged into the output dtype) over four parts, fused Triton merge and torch merge,
    each against a float64 reference; parts in [B, S, H, D] and in [B, H, S, D] memory (as attention kernels may
    return them), some rows without keys in a part (lse -inf, out 0). The fused merge fails the gate where the ring
    uses it: under the default parallel.fused_merge (on)."""
    from mtrain.ops.switches import DEFAULTS, Switches
    from mtrain.parallel import merge as merge_mod

    gen = torch.Generator(device=device).manual_seed(5)
    B, S, H, D = 2, 1000, 8, 128
    lines = []
    for layout in ("bshd", "bhsd"):
        parts = []
        for i in range(4):
            o = torch.randn(B, S, H, D, generator=gen, device=device).to(dtype)
            if layout == "bhsd":
                o = o.transpose(1, 2).contiguous().transpose(1, 2)
            lse = torch.randn(B, H, S, generator=gen, device=device) * 3
            if i == 1:
                lse[:, :, :100] = float("-inf")
                o[:, :100] = 0
            parts.append((o, lse))
        lse64 = torch.logsumexp(torch.stack([l.double() for _, l in parts]), 0)  # [B, H, S]
        want = sum(o.double() * torch.exp(l.double() - lse64).transpose(1, 2)[..., None] for o, l in parts)
        saved = DEFAULTS.fused_merge
        for fused in (True, False):
            acc = merge_mod.PartialAccumulator(parts[0][0], switches=Switches(fused_merge=fused))
            for i, (o, l) in enumerate(parts):
                acc.add(o.clone(), l.clone(), final=i == len(parts) - 1)
            out, lse = acc.result(dtype)
            torch.cuda.synchronize(device) if device.type == "cuda" else None
            err = rel(out, want)
            lse_err = float((lse.double() - lse64).abs().max())
            bad = err > TOL[dtype][0] or lse_err > 1e-4 or not math.isfinite(err)
            # the fused merge fails the gate only while the ring uses it (parallel.fused_merge); off, its result is
            # reported
            used = not fused or saved
            label = "fused" if saved else "fused (off: not used by the ring)"
            status = ("FAIL" if used else "bad ") if bad else "ok  "
            lines.append(f"{status} {'merge':13s} {tag} {label if fused else 'torch'} {layout}: out {err:.1e} "
                         f"lse {lse_err:.1e}")
    # the owners' sum of the gathered schedule's dK/dV parts (`RankParts.sum`, one Triton pass under fused_merge) must
    # equal the sum in rank order (rank 0's part widened, the others added in fp32, rounded once) bit for bit
    for world in (2, 4, 8):
        for rank in sorted({0, world - 1}):
            grads = [torch.randn(1, 3000, 2, 128, generator=gen, device=device).to(dtype) for _ in range(world)]
            held = merge_mod.RankParts.receiving(grads[rank].clone(), world, rank)
            for o in range(world):
                if o != rank:
                    held.part(o).copy_(grads[o])
            got = held.sum(dtype, switches=DEFAULTS)
            want = grads[0].to(merge_mod.accum_dtype(grads[0]), copy=True)
            for g in grads[1:]:
                want.add_(g)
            same = torch.equal(got, want.to(dtype))
            exact = sum(g.double() for g in grads)
            lines.append(f"{'ok  ' if same else 'FAIL'} {'merge':13s} {tag} sum-parts W={world} rank {rank} "
                         f"{'fused' if DEFAULTS.fused_merge and device.type == 'cuda' else 'torch'}: "
                         f"== rank-order sum {same}, "
                         f"out {rel(got, exact):.1e}")
    return lines


def repeat_case(q, k, v, index, doc_ids, bs, dout, tag, remake) -> list[str]:
    """Bitwise repeatability on the device: the deterministic engines' forward + backward run twice under
    `torch.use_deterministic_algorithms(True)` must give identical out, dq, dk, dv (FAIL otherwise): "triton-det"
    (`vertical_slash_attention`, our deterministic backward), "fa4-det" where FA4 runs, and "ring" (`ring_attention`
    on a one-rank group: its step kernels, column path and merges). The atomic backwards ("triton-atomic", and "fa4"
    where it runs: fp32 atomics add dQ) run twice too, with the deterministic setting as it was, and are labelled
    atomic: a last-bit difference there is reported, never failed. One line per engine. The ring runs the case
    remade at whole blocks (`remake(S)`; the layout splits whole blocks only)."""
    from mtrain.parallel import Layout, ring_attention

    device, dtype = q.device, q.dtype
    whole = q.shape[1] // bs * bs
    q_w, k_w, v_w, index_w, doc_w = remake(whole)

    def ring(a, b, c):
        _one_rank_group(device)
        layout = Layout.create("block-stripe", world_size=1, granularity=bs)
        return ring_attention(a, b, c, layout=layout, index=index_w, engine="auto", doc_ids=doc_w)

    deterministic = {"triton-det": lambda a, b, c: vertical_slash_attention(a, b, c, index, impl="triton",
                                                                             doc_ids=doc_ids)}
    atomic = {"triton-atomic": lambda a, b, c: vertical_slash_attention(a, b, c, index, impl="triton",
                                                                         deterministic=False, doc_ids=doc_ids)}
    if fa4_eligible(device, index, dtype):
        deterministic["fa4-det"] = lambda a, b, c: vertical_slash_attention(a, b, c, index, impl="fa4",
                                                                            doc_ids=doc_ids)
        atomic["fa4"] = lambda a, b, c: vertical_slash_attention(a, b, c, index, impl="fa4", deterministic=False,
                                                                 doc_ids=doc_ids)
    deterministic["ring"] = ring

    def twice(fn, ring=False):
        args = (q_w, k_w, v_w, dout[:, :whole].contiguous()) if ring else (q, k, v, dout)
        first, second = engine_grads(fn, *args), engine_grads(fn, *args)
        return [float((a.double() - b.double()).abs().max()) if not torch.equal(a, b) else 0.0
                for a, b in zip(first, second)], all(torch.equal(a, b) for a, b in zip(first, second))

    lines = []
    # cuBLAS refuses to run under deterministic algorithms without a fixed workspace (our kernels are Triton)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for name, fn in deterministic.items():
            diffs, same = twice(fn, ring=name == "ring")
            lines.append(f"{'ok  ' if same else 'FAIL'} {'repeat':13s} {tag} {name}: two runs bitwise equal: {same}"
                         + ("" if same else " (max |diff| out/dq/dk/dv " + "/".join(f"{d:.1e}" for d in diffs) + ")"))
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
    for name, fn in atomic.items():
        diffs, same = twice(fn)
        lines.append(f"ok   {'repeat':13s} {tag} {name} (atomic backward, not required to repeat): two runs bitwise "
                     f"equal: {same}" + ("" if same else " (max |diff| out/dq/dk/dv "
                                                        + "/".join(f"{d:.1e}" for d in diffs) + ")"))
    return lines


def compile_listener(record: dict):
    """Register a Triton compilation listener that sums, per kernel name, [compiles, seconds] into `record` (cache
    hits are not counted). Returns False where this Triton has no listener hook."""
    try:
        from triton import knobs
    except ImportError:
        return False
    if not hasattr(knobs, "compilation") or not hasattr(knobs.compilation, "listener"):
        return False

    def listen(*, src, metadata, metadata_group, times, cache_hit):
        if cache_hit:
            return
        name = metadata.get("name") or getattr(getattr(src, "fn", None), "__name__", "?")
        entry = record.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += times.total / 1e6

    knobs.compilation.listener = listen
    return True


def run_case(case) -> tuple[list[str], list[str], dict, dict]:
    """One (block size, dtype, heads, documents) case: every engine against float64; (lines, failures, seconds per
    engine: its compiles and its run, Triton compiles per kernel name: [count, seconds])."""
    bs, dtype_name, (Hq, Hkv, D), doc, S, device_name, seed, only = case
    dtype, device = getattr(torch, dtype_name), torch.device(device_name)
    lines, failures, seconds, compiles = [], [], {}, {}
    if device.type == "cuda":
        compile_listener(compiles)
    clock = [time.time()]

    def lap(name):
        now = time.time()
        seconds[name] = seconds.get(name, 0.0) + now - clock[0]
        clock[0] = now

    q, k, v, index, doc_ids = make_case(S, Hq, Hkv, D, bs, dtype, doc, device, seed=seed)
    dout = torch.randn_like(q)
    same_doc = None if doc_ids is None else doc_ids[0][:, None] == doc_ids[0][None, :]
    mask = index.to_mask() if same_doc is None else index.to_mask() & same_doc
    want = reference_grads(q, k, v, mask, dout)
    dense_mask = torch.ones(S, S, dtype=torch.bool, device=device).tril()
    want_dense = reference_grads(q, k, v, dense_mask if same_doc is None else dense_mask & same_doc, dout)
    tol_out, tol_grad = TOL[dtype]
    tag = f"bs={bs:3d} {dtype_name:8s} H={Hq}/{Hkv}x{D:<3d} docs={int(doc)}"
    lap("reference")

    def report(name, errs):
        bad = errs[0] > tol_out or max(errs[1:]) > tol_grad or not all(math.isfinite(e) for e in errs)
        line = (f"{'FAIL' if bad else 'ok  '} {name:13s} {tag} density={index.density():.2f}: out {errs[0]:.1e} "
                f"dq {errs[1]:.1e} dk {errs[2]:.1e} dv {errs[3]:.1e}")
        lines.append(line)
        if bad:
            failures.append(line)

    def raised(name, exc):
        line = f"FAIL {name:13s} {tag}: raised {exc!r:.300}"
        lines.append(line)
        failures.append(line)

    def wanted(name):
        return not only or name in only

    todo = {name: fn for name, fn in engines(device, index, doc_ids, S, dtype).items() if wanted(name)}
    for name, fn in todo.items():
        try:
            got = engine_grads(fn, q, k, v, dout)
        except Exception as exc:  # noqa: BLE001 - a gate reports every engine's failure and goes on
            raised(name, exc)
            lap(name)
            continue
        report(name, [rel(a, b) for a, b in zip(got, want_dense if name.startswith("dense") else want)])
        lap(name)
    if wanted("fa4-nocols") and fa4_eligible(device, index, dtype):
        try:  # FA4 alone: the same slashes without verticals, so the column path does not run
            _, _, _, index_nc, _ = make_case(S, Hq, Hkv, D, bs, dtype, doc, device, seed=seed, columns=False)
            mask_nc = index_nc.to_mask() if same_doc is None else index_nc.to_mask() & same_doc
            want_nc = reference_grads(q, k, v, mask_nc, dout)
            got = engine_grads(lambda a, b, c: vertical_slash_attention(a, b, c, index_nc, impl="fa4",
                                                                        deterministic=False, doc_ids=doc_ids),
                               q, k, v, dout)
            report("fa4-nocols", [rel(a, b) for a, b in zip(got, want_nc)])
        except Exception as exc:  # noqa: BLE001
            raised("fa4-nocols", exc)
        lap("fa4-nocols")
    def lines_case(name, fn):
        """A case that reports lines of its own (ok / FAIL ...)."""
        try:
            for line in fn():
                lines.append(line)
                if line.startswith("FAIL"):
                    failures.append(line)
        except Exception as exc:  # noqa: BLE001
            raised(name, exc)
        lap(name)

    def line_case(name, fn):
        """A case that reports one line of its own."""
        lines_case(name, lambda: [fn()])

    if wanted("estimator"):
        line_case("estimator", lambda: estimator_case(q, k, doc_ids, bs, tag))
    if wanted("ring-step"):
        try:
            want_step, got_step = ring_step_case(q, k, v, index, doc_ids, bs, dout)
            report("ring-step", [rel(a, b) for a, b in zip(got_step, want_step)])
        except Exception as exc:  # noqa: BLE001
            raised("ring-step", exc)
        lap("ring-step")
    def whole_block_case(name, fn):
        """A ring case on the case remade at whole blocks (a layout splits whole blocks only), with its own
        reference: fn(q, k, v, index, doc_ids, bs, dout) -> (out, dq, dk, dv)."""
        try:
            q_w, k_w, v_w, index_w, doc_w = make_case(S // bs * bs, Hq, Hkv, D, bs, dtype, doc, device, seed=seed)
            dout_w = torch.randn_like(q_w)
            mask_w = index_w.to_mask()
            if doc_w is not None:
                mask_w = mask_w & (doc_w[0][:, None] == doc_w[0][None, :])
            want_w = reference_grads(q_w, k_w, v_w, mask_w, dout_w)
            got_w = fn(q_w, k_w, v_w, index_w, doc_w, bs, dout_w)
            report(name, [rel(a, b) for a, b in zip(got_w, want_w)])
        except Exception as exc:  # noqa: BLE001
            raised(name, exc)
        lap(name)

    if wanted("ring-dense"):
        try:
            got, want_rank = dense_gather_case(q, k, v, doc_ids, dout)
            report("ring-dense", [rel(a, b) for a, b in zip(got, want_rank)])
        except Exception as exc:  # noqa: BLE001
            raised("ring-dense", exc)
        lap("ring-dense")
    if wanted("ring-fa4") and device.type == "cuda":
        whole_block_case("ring-fa4", ring_engine_case)
    if wanted("ring-listfree") and device.type == "cuda":
        whole_block_case("ring-listfree", ring_list_free_case)
    if wanted("ring-estimate") and device.type == "cuda":
        line_case("ring-estimate", lambda: ring_estimator_case(q, k, doc_ids, bs, tag))
    if wanted("merge") and device.type == "cuda" and doc:
        lines_case("merge", lambda: merge_case(device, dtype, tag))
    if wanted("repeat"):
        remake = lambda n: make_case(n, Hq, Hkv, D, bs, dtype, doc, device, seed=seed)  # noqa: E731
        lines_case("repeat", lambda: repeat_case(q, k, v, index, doc_ids, bs, dout, tag, remake))
    return lines, failures, seconds, compiles


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq", type=int, default=2100, help="sequence length (ragged on purpose)")
    ap.add_argument("--quick", action="store_true", help="one GQA shape, short sequence (CPU smoke)")
    ap.add_argument("--dtypes", nargs="+", help="dtypes to check (default: float32 float16, and bfloat16 on CUDA)")
    ap.add_argument("--jobs", type=int,
                    help="cases run in this many processes at once (default: every case at once, up to twice the "
                         "host's cores; the Triton compiles dominate and run in parallel on the host's cores, "
                         "sharing the GPU: 24 processes took 98 s for the 24 cases on a 16-core H200 host)")
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--compile-rows", type=int, default=20,
                    help="kernels listed in the Triton compile summary (costliest first)")
    ap.add_argument("--heads", nargs="+", metavar="HQxHKVxD",
                    help="head shapes (default 4x4x64 8x2x128; --quick: 4x2x64)")
    ap.add_argument("--engines", nargs="+", metavar="NAME",
                    help="check only these (triton-det triton-atomic triton-listfree triton-lf-atomic dense dense-fa4 "
                         "dense-sdpa dense-triton ring-dense flex fa4 "
                         "fa4-det fa4-listfree fa4-nocols estimator ring-step ring-fa4 ring-listfree ring-estimate merge "
                         "repeat); default all that apply")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("on the CPU the Triton kernels need TRITON_INTERPRET=1")
    dtypes = args.dtypes or (["float32", "float16"] + (["bfloat16"] if device.type == "cuda" else []))
    heads = [(4, 4, 64), (8, 2, 128)] if not args.quick else [(4, 2, 64)]
    if args.heads:
        heads = [tuple(int(x) for x in h.split("x")) for h in args.heads]
    S = args.seq if not args.quick else 200
    only = tuple(args.engines or ())
    cases = [(bs, dt, h, doc, S, args.device, i, only) for i, (bs, dt, h, doc) in
             enumerate(itertools.product(args.block_sizes, dtypes, heads, [False, True]))]
    if device.type == "cuda" and 128 in args.block_sizes and (not only or any("fa4" in e for e in only)):
        if not fa4_importable():
            print("skip fa4 fa4-det fa4-nocols: flash_attn.cute (FlashAttention-4) is not importable here")
    jobs = args.jobs or min(len(cases), 2 * (os.cpu_count() or 1))
    # Flex's inductor compiles in each case's own process: a pool of compile workers per process (one per core,
    # each importing torch) would crowd out the other cases' Triton compiles.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    t0 = time.time()
    failures = []
    if jobs <= 1:
        results = map(run_case, cases)
    else:
        import concurrent.futures
        import multiprocessing

        pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
        results = pool.map(run_case, cases)
    seconds, compiles, per_case = {}, {}, []
    for case, (lines, bad, secs, comp) in zip(cases, results):
        for line in lines:
            print(line, flush=True)
        failures += bad
        per_case.append((sum(secs.values()), sum(t for _, t in comp.values()), case))
        for name, t in secs.items():
            seconds[name] = seconds.get(name, 0.0) + t
        for name, (n, t) in comp.items():
            entry = compiles.setdefault(name, [0, 0.0])
            entry[0] += n
            entry[1] += t
    if compiles:
        ranked = sorted(compiles.items(), key=lambda kv: -kv[1][1])
        print(f"Triton compiles: {sum(n for n, _ in compiles.values())} kernels, "
              f"{sum(t for _, t in compiles.values()):.0f} s summed over cases; per kernel (compiles, seconds): "
              + ", ".join(f"{name} {n} {t:.0f}" for name, (n, t) in ranked[:args.compile_rows]))
    slow = sorted(per_case, key=lambda c: -c[0])[:4]
    print("slowest cases (seconds in the case / of it Triton compiles): " + ", ".join(
        f"bs={c[0]} {c[1]} H={'x'.join(map(str, c[2]))} docs={int(c[3])} {t:.0f}/{ct:.0f}" for t, ct, c in slow))
    print("seconds per engine, summed over cases (compiles included; cases run side by side): "
          + ", ".join(f"{name} {t:.0f}" for name, t in sorted(seconds.items(), key=lambda kv: -kv[1])))
    print(f"{len(cases)} cases, {len(failures)} failures, {time.time() - t0:.0f} s "
          f"(tolerances out/grads: " + ", ".join(f"{str(d)[6:]} {a:g}/{b:g}" for d, (a, b) in TOL.items()) + ")")
    for f in failures:
        print("FAILED:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

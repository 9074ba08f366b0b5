"""Activation memory of long sequences (mtrain.models.memory): the chunked MLP (model.mlp_chunk) and the activation
offload (train.offload_activations) give the same loss and gradients as the plain model (fp32 on the CPU: relative
error <= 1e-6), with and without activation checkpointing, on tiny Qwen2 and Llama models; the chunked MLP holds a
chunk's intermediates at a time, and the offload moves the checkpointed layers' inputs."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from mtrain.config import check_mlp_chunk
from mtrain.errors import ConfigError
from mtrain.models.memory import OffloadActivations, chunk_mlp
from mtrain.attention_settings import PolicySettings
from mtrain.models.runtime import AttentionRuntime, AttentionSettings, attach_runtime
from mtrain.tiny import tiny_config
from mtrain.train.loss import ChunkedLossLM

SEQ = 96
TOL = 1e-6  # relative (max abs difference / max abs value), fp32


def _config(family: str):
    qwen = tiny_config()
    if family == "qwen2":
        return qwen
    fields = {k: getattr(qwen, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                            "num_attention_heads", "num_key_value_heads", "head_dim")}
    return LlamaConfig(**fields, max_position_embeddings=4096, tie_word_embeddings=False)


def _model(family: str, checkpointing: bool):
    torch.manual_seed(0)
    cfg = _config(family)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    if checkpointing:
        rt = attach_runtime(model, AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse()))).mtrain_runtime  # as the trainer's loader attaches one
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": rt.checkpoint_contexts})
    model.config.use_cache = False
    model.train()
    return model


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(0, 700, (1, SEQ))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    return ids, torch.arange(SEQ)[None], labels


def _step(model, offload: bool = False):
    lm = ChunkedLossLM(model, chunk=40)
    ids, pos, labels = _batch()
    model.zero_grad(set_to_none=True)
    with OffloadActivations(min_bytes=0, include_cpu=True) if offload else contextlib.nullcontext():
        loss, _ = lm(ids, pos, labels)
    loss.backward()
    return loss.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _assert_same(got, want):
    assert _rel(got[0], want[0]) <= TOL
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        assert _rel(got[1][name], want[1][name]) <= TOL, name


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_chunked_mlp_matches(family, checkpointing):
    want = _step(_model(family, checkpointing))
    model = _model(family, checkpointing)
    names = set(model.state_dict())
    assert chunk_mlp(model, 32) == model.config.num_hidden_layers  # 96 tokens: chunks of 32, 32, 32
    assert set(model.state_dict()) == names  # parameters and their names untouched
    _assert_same(_step(model), want)
    chunk_mlp(model, 25)  # again: replaces the chunking (uneven last chunk), does not nest it
    _assert_same(_step(model), want)


def _peak_intermediate(model) -> int:
    """The most elements of [.., intermediate_size] activations alive at once during a step of `model` (forward,
    recomputations and backward: every op output of that width is counted until it is freed)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    width = model.config.intermediate_size
    state = {"alive": 0, "peak": 0}

    def gone(n):
        state["alive"] -= n

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == width and t.shape[-2] != 128:
                    state["alive"] += t.numel()
                    state["peak"] = max(state["peak"], state["alive"])
                    weakref.finalize(t, gone, t.numel())
            return out

    with Count():
        _step(model)
    return state["peak"]


def test_chunked_mlp_holds_chunk_sized_intermediates():
    """Without chunks a layer's MLP holds several [S, intermediate] tensors at once (gate, up, activation,
    product, their gradients); with chunks of 32 of the 96 tokens, at most a chunk's worth of them at a time:
    with and without activation checkpointing (the chunk's checkpoint nests in the layer's)."""
    cfg = tiny_config()
    for checkpointing in (False, True):
        plain = _peak_intermediate(_model("qwen2", checkpointing))
        assert plain >= 3 * SEQ * cfg.intermediate_size
        model = _model("qwen2", checkpointing)
        chunk_mlp(model, 32)
        chunked = _peak_intermediate(model)
        assert chunked <= plain * 32 / SEQ, (checkpointing, plain, chunked)


def test_mlp_chunk_key_is_checked():
    check_mlp_chunk(None)
    check_mlp_chunk(0)
    check_mlp_chunk(8192)
    for bad in (-1, 1.5, True, "8k"):
        with pytest.raises(ConfigError, match=r"model\.mlp_chunk: must be a whole number of tokens >= 0.*e\.g\."):
            check_mlp_chunk(bad)


def test_recipe_rejects_a_negative_mlp_chunk(tmp_path):
    from mtrain.config import load_recipe

    data = tmp_path / "packed"
    data.mkdir()
    (data / "index.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"model\.mlp_chunk"):
        load_recipe(None, [f"data.path={data}", "model.config=mtrain/assets/tiny-qwen2/config.json",
                           "model.tokenizer=mtrain/assets/tiny-tokenizer", "model.mlp_chunk=-8",
                           f"train.output_dir={tmp_path / 'run'}"])


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_offloaded_activations_match(family):
    """train.offload_activations (OffloadActivations around the forward) on a checkpointed model, alone and with the
    chunked MLP, and on a model without checkpointing: the same loss and gradients."""
    for checkpointing in (True, False):
        want = _step(_model(family, checkpointing))
        model = _model(family, checkpointing)
        _assert_same(_step(model, offload=True), want)
        chunk_mlp(model, 32)
        _assert_same(_step(model, offload=True), want)


def test_offload_moves_the_checkpointed_layer_inputs():
    """Under non-reentrant checkpointing each layer's input [1, S, hidden] is a saved tensor of the enclosing graph,
    so the offload moves one per layer (and the rest the graph saves outside the layers), and no parameter."""
    model = _model("qwen2", True)
    ids, pos, labels = _batch()
    hooks = OffloadActivations(min_bytes=0, include_cpu=True)
    shapes = []
    pack = hooks.pack_hook

    def spy(t):
        packed = pack(t)
        if isinstance(packed, tuple):
            shapes.append(tuple(t.shape))
        return packed

    hooks.pack_hook = spy
    with hooks:
        loss, _ = ChunkedLossLM(model, chunk=40)(ids, pos, labels)
    loss.backward()
    hidden = model.config.hidden_size
    # the layers' inputs, the final norm's input and output (fp32: the same tensor), its normalised input
    assert shapes.count((1, SEQ, hidden)) >= model.config.num_hidden_layers
    assert (model.config.vocab_size, hidden) not in shapes  # the tied embedding / LM head weight stays
    assert hooks.moved > 0


def tiny_losses(tmp_path, runs, *, steps: int, docs: dict, attention: dict | None = None) -> dict:
    """{name: per-step losses} of tiny-model trainer runs (one process, fp32, deterministic, activation checkpointing,
    256-token samples of synthetic documents made by CorpusSpec(**docs)); runs: (name, model keys, train keys)."""
    import json

    import yaml

    from mtrain.config import load_recipe
    from mtrain.data import pack
    from mtrain.data.synthetic import CorpusSpec, generate, write_jsonl
    from mtrain.tiny import MODEL_CONFIG, TOKENIZER_DIR
    from mtrain.train.trainer import Trainer

    write_jsonl(tmp_path / "docs.jsonl", generate(CorpusSpec(**docs)))
    pack([f"{tmp_path / 'docs.jsonl'}:jsonl"], str(TOKENIZER_DIR), 256, tmp_path / "packed", progress=False, workers=1)
    losses = {}
    before = torch.are_deterministic_algorithms_enabled()
    try:
        for name, model_keys, train_keys in runs:
            recipe = {"model": {"config": str(MODEL_CONFIG), "tokenizer": str(TOKENIZER_DIR),
                                "gradient_checkpointing": True, **model_keys},
                      "data": {"path": str(tmp_path / "packed"), "seq_len": 256},
                      "optim": {"lr": 3e-3, "warmup_steps": 1}, "logging": {"wandb": "disabled"},
                      "train": {"output_dir": str(tmp_path / name), "max_steps": steps, "save_every": 0,
                                "export": False, "deterministic": True, **train_keys}}
            if attention:
                recipe["attention"] = attention
            path = tmp_path / f"{name}.yaml"
            path.write_text(yaml.safe_dump(recipe))
            Trainer(load_recipe(path)).run()
            rows = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
            losses[name] = [json.loads(r)["loss"] for r in rows]
    finally:
        torch.use_deterministic_algorithms(before)
    return losses


def test_trainer_with_the_memory_keys_gives_the_same_losses(tmp_path):
    """One process, tiny model, activation checkpointing: model.mlp_chunk, train.offload_activations and
    train.memory_record (a no-op without CUDA) through the trainer give the plain run's losses (fp32, 1e-6)."""
    losses = tiny_losses(tmp_path, (("plain", {}, {}),
                                    ("memory", {"mlp_chunk": 48}, {"offload_activations": True, "memory_record": True})),
                         steps=3, docs={"num_docs": 40, "max_sentences": 40, "seed": 5})
    assert len(losses["plain"]) == 3
    for a, b in zip(losses["memory"], losses["plain"]):
        assert abs(a - b) <= 1e-6 * abs(b), losses
    assert not (tmp_path / "memory" / "memory").exists()  # no CUDA: nothing recorded


def test_trainer_profiles_the_step_it_is_asked_to(tmp_path):
    """train.profile_step 2 on a 2-step run: RUN/profile/rank0.txt holds step 2's wall time, one line per layer's
    attention calls (forward and the checkpointed recompute: 2 calls a layer) and the operator tables; the losses are
    the unprofiled run's (fp32, 1e-6)."""
    import json

    from mtrain.tiny import MODEL_CONFIG

    losses = tiny_losses(tmp_path, (("plain", {}, {"profile_step": 0}), ("profiled", {}, {"profile_step": 2})),
                         steps=2, docs={"num_docs": 20, "max_sentences": 30, "seed": 3},
                         attention={"kind": "mtraining", "block_size": 32, "sparse_policy": "always"})
    for a, b in zip(losses["profiled"], losses["plain"], strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), losses
    assert not (tmp_path / "plain" / "profile").exists()
    text = (tmp_path / "profiled" / "profile" / "rank0.txt").read_text()
    assert text.startswith("# step 2\n# step wall time ")
    layers = json.loads(MODEL_CONFIG.read_text())["num_hidden_layers"]
    for layer in range(layers):
        line = next(x for x in text.splitlines() if x.startswith(f"mtrain.attention L{layer:02d} "))
        assert int(line.split()[2]) == 2, line  # the forward and the checkpointed recompute
    assert "most self host time" in text  # (the device table only where a GPU was recorded)
    assert "aten::" in text
    inside = text.split("inside the attention calls")[1].split("\n\n")[0].splitlines()[1:]
    assert inside[-1].startswith("every entry inside") and len(inside) > 3, inside
    assert not any(x.startswith("mtrain.attention") for x in inside), inside
    assert text.rstrip().endswith("none recorded")  # no CUDA runtime calls on the CPU


def test_profile_attributes_operators_to_the_attention_calls_they_ran_in():
    """`inside_attention` counts the operators under an attention call's range (nested ones included) and none
    outside it."""
    from torch.profiler import ProfilerActivity, profile

    from mtrain.models.attention import profile_range
    from mtrain.train.step_profile import inside_attention

    x = torch.randn(8, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.nn.functional.silu(x)
        with profile_range(3):
            torch.mm(x, x)
            with torch.profiler.record_function("est:1 score"):
                torch.exp(x)
        with profile_range(4):
            torch.mm(x, x)
    got = inside_attention(prof.events())
    assert got["aten::mm"][0] == 2 and got["aten::exp"][0] == 1 and got["est:1 score"][0] == 1, got
    assert "aten::silu" not in got and not any(name.startswith("mtrain.attention") for name in got), got


def test_profile_names_where_the_host_waited_and_who_called():
    """`host_waits` counts the named runtime calls (here aten::_local_scalar_dense, which a GPU's .item() turns into a
    stream synchronisation, stands in for them), split by inside / outside the attention ranges, with their callers
    innermost first; other operators are not counted. The table names each and sums per call and place."""
    from torch.profiler import ProfilerActivity, profile

    from mtrain.models.attention import profile_range
    from mtrain.train.step_profile import _waits_table, host_waits

    x = torch.randn(8, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        x.sum().item()
        with profile_range(3):
            with torch.profiler.record_function("est:1 score"):
                x.sum().item()
                x.max().item()
            torch.mm(x, x)
    got = host_waits(prof.events(), names=("aten::_local_scalar_dense",))
    assert got[("aten::_local_scalar_dense", "outside", "aten::item")][0] == 1, got
    assert got[("aten::_local_scalar_dense", "attention", "aten::item < est:1 score")][0] == 2, got
    assert len(got) == 2, got
    assert host_waits(prof.events()) == {}  # no CUDA runtime calls on the CPU
    lines = _waits_table(got, top=10)
    assert any("every caller" in x and "attention" in x and x.split()[-2] == "2" for x in lines), lines
    assert "none recorded" in _waits_table({}, top=10)[-1]


def test_checkpointed_model_holds_no_replayed_index_after_its_layers_forward(monkeypatch):
    """On a GPU each layer's index comes from a CUDA-graph replay as views into one flat buffer
    (`mtrain.ops.graphed`); here every estimate is passed through that packing (the replay's unpack) so
    the CPU runs the same views. Under activation checkpointing a layer's forward must leave none of them alive:
    after the model's forward, before the backward, no tensor of any layer's index remains (the layer's log record
    and its recomputation lines keep copies of their own), and the step's gradients equal an unpacked run's."""
    import gc
    import weakref

    import mtrain.ops.graphed as graphed
    from mtrain.models.registry import attention_runtime
    from mtrain.ops.partial_autograd import split_tensors

    real = graphed.estimate_graphed
    views = []

    def replayed(*args, **kwargs):
        index = real(*args, **kwargs)
        tree = graphed._clone(index)  # as a replay returns it: every tensor a view of one flat buffer
        tensors = []
        split_tensors((tree.block_ids, tree.block_counts, tree.col_ids, tree.col_counts, dict(tree._cache)), tensors)
        views.extend(weakref.ref(t) for t in tensors)
        return tree

    results = []
    for packed in (False, True):
        monkeypatch.setattr(graphed, "estimate_graphed", replayed if packed else real)
        torch.manual_seed(0)
        rt = attention_runtime("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy="always", block_size=16, recall=0.9)
        model = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32, attn_implementation=rt.name)
        attach_runtime(model, rt)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": rt.checkpoint_contexts})
        model.config.use_cache = False
        model.train()
        ids, pos, labels = _batch()
        loss, _ = ChunkedLossLM(model, chunk=40)(ids, pos, labels)
        if packed:
            gc.collect()
            assert len(rt.records.layers) == model.config.num_hidden_layers
            assert all(r.path == "sparse" for r in rt.records.layers)
            assert views and not [ref for ref in views if ref() is not None]
        loss.backward()
        results.append((loss.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters()}))
    _assert_same(results[1], results[0])

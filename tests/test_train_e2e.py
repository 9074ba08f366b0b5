"""End to end on the tiny model: pack -> train -> kill -9 -> resume (bit-identical) -> export -> compare."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mtrain.data.synthetic import CorpusSpec, generate, write_jsonl
from mtrain.tiny import MODEL_CONFIG, TOKENIZER_DIR
from planted import Payload
from ranks import run_cli, run_mtrain, start

REPO = Path(__file__).resolve().parents[1]
SEQ = 256


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    from mtrain.data import pack

    root = tmp_path_factory.mktemp("data")
    write_jsonl(root / "docs.jsonl", generate(CorpusSpec(num_docs=120, max_sentences=40, seed=5)))
    pack([f"{root / 'docs.jsonl'}:jsonl"], str(TOKENIZER_DIR), SEQ, root / "packed", progress=False, workers=1)
    return root / "packed"


def _recipe(tmp_path: Path, packed: Path, out: str, **train) -> Path:
    import yaml

    recipe = {
        "model": {"config": str(MODEL_CONFIG), "tokenizer": str(TOKENIZER_DIR)},
        "data": {"path": str(packed), "seq_len": SEQ},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "logging": {"wandb": "disabled"},
        "train": {"output_dir": str(tmp_path / out), "max_steps": 6, "save_every": 3, "micro_batch_size": 2,
                  "grad_accum": 2, "deterministic": True, **train},
    }
    path = tmp_path / f"{out}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _torchrun(nproc: int, *args):
    """`torchrun --standalone -m mtrain ARGS`, its ranks forked as torchrun would start them (tests/ranks.py start);
    returns at once: `kill()` sends every rank SIGKILL, as kill -9 of the launcher's process group."""
    return start(nproc, "-m mtrain", *args)


def _finish(launch, timeout: float = 600) -> tuple[int, str]:
    """Wait for a launch: (its exit status, the ranks' output)."""
    try:
        returncode = launch.wait(timeout)
        return returncode, "".join(launch.output())
    finally:
        launch.close()


def _kill_after_checkpoint(launch, marker: Path, step: str) -> None:
    """SIGKILL every process of `launch` once `marker` (checkpoints/latest) names `step`."""
    deadline = time.time() + 300
    while not (marker.exists() and marker.read_text().strip() == step):
        assert launch.poll() is None, "".join(launch.output())[-3000:]
        assert time.time() < deadline
        time.sleep(0.05)
    launch.kill()
    launch.close()


def _losses(run: Path) -> dict:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


GOLDEN = Path(__file__).resolve().parent / "assets" / "losses" / "tiny-cp2.json"


def _check_golden(losses: dict) -> None:
    """The tiny CP=2 loss curve must not drift from the committed one (MTRAIN_UPDATE_GOLDEN=1 rewrites it).

    The tolerance allows for another CPU's float rounding, not for a change in what is computed.
    """
    if os.environ.get("MTRAIN_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps({str(k): v for k, v in sorted(losses.items())}, indent=1) + "\n")
    golden = {int(k): v for k, v in json.loads(GOLDEN.read_text()).items()}
    assert sorted(golden) == sorted(losses)
    for step, loss in losses.items():
        assert abs(loss - golden[step]) <= 1e-3 * abs(golden[step]), (step, loss, golden[step])


def test_train_resume_export(tmp_path, packed):
    """CP=2 under torchrun: 6 steps straight vs killed (kill -9) after the step-3 checkpoint and rerun."""
    cp2 = ["--set", "parallel.cp_size=2"]  # packed documents masked inside the ring
    returncode, out = _finish(_torchrun(2, "train", str(_recipe(tmp_path, packed, "full")), *cp2))
    assert returncode == 0, out
    ref = _losses(tmp_path / "full")
    assert sorted(ref) == [1, 2, 3, 4, 5, 6]
    assert ref[6] < ref[1]
    _check_golden(ref)

    # Same recipe, killed with SIGKILL once the step-3 checkpoint is committed, then rerun unchanged.
    recipe = _recipe(tmp_path, packed, "killed")
    _kill_after_checkpoint(_torchrun(2, "train", str(recipe), *cp2), tmp_path / "killed" / "checkpoints" / "latest",
                           "step-0000003")
    returncode, out = _finish(_torchrun(2, "train", str(recipe), *cp2))
    assert returncode == 0, out
    assert "resumed from" in out
    got = _losses(tmp_path / "killed")
    assert got == ref  # bit-identical, every step, no duplicated lines

    # The exported checkpoint is a plain HF folder that transformers loads with the trained weights.
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    final = tmp_path / "killed" / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    saved = load_file(str(tmp_path / "killed" / "checkpoints" / "step-0000006" / "model.safetensors"))
    trained = {k.removeprefix("model."): v for k, v in saved.items()}
    assert len(trained) >= len(model.state_dict()) - 1  # all but a tied lm_head
    for name, tensor in model.state_dict().items():
        if name in trained:
            assert torch.equal(tensor, trained[name]), name
    # ... and gives the trained model's logits: plain transformers (sdpa) vs mtrain's own attention.
    from mtrain.config import load_recipe
    from mtrain.models.registry import recipe_runtime
    from mtrain.models.runtime import attach_runtime

    rt = recipe_runtime(load_recipe(recipe, ["parallel.cp_size=1"]))  # one device, no documents
    ours = attach_runtime(AutoModelForCausalLM.from_pretrained(final, attn_implementation=rt.name), rt)
    ids = torch.randint(0, 700, (1, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain, trained_logits = model(ids).logits, ours(ids).logits
    assert torch.allclose(plain, trained_logits, atol=1e-5, rtol=1e-5)

    cmp = subprocess.run([sys.executable, "-m", "mtrain", "compare", str(tmp_path / "full"), str(tmp_path / "killed"),
                          "--plot", str(tmp_path / "cmp.png")], capture_output=True, text=True, cwd=REPO)
    assert cmp.returncode == 0, cmp.stderr
    assert "final loss" in cmp.stdout and "killed" in cmp.stdout
    assert (tmp_path / "cmp.png").stat().st_size > 1000


def test_yarn_written_to_exported_config(tmp_path, packed):
    from transformers import AutoConfig

    from mtrain.config import load_recipe
    from mtrain.train.trainer import Trainer

    base = load_recipe(_recipe(tmp_path, packed, "base", max_steps=1, save_every=0))
    Trainer(base).run()
    ext = load_recipe(None, [
        f"model.path={tmp_path / 'base' / 'final'}", "model.rope_scaling.rope_type=yarn",
        "model.rope_scaling.factor=4.0", "model.rope_scaling.original_max_position_embeddings=1024",
        f"data.path={packed}", f"data.seq_len={SEQ}", "logging.wandb=disabled",
        f"train.output_dir={tmp_path / 'ext'}", "train.max_steps=1",
    ])
    Trainer(ext).run()
    raw = json.loads((tmp_path / "ext" / "final" / "config.json").read_text())
    assert raw["max_position_embeddings"] == 4096
    assert raw["rope_scaling"]["type"] == "yarn" and raw["rope_scaling"]["factor"] == 4.0
    assert raw["rope_scaling"]["original_max_position_embeddings"] == 1024
    cfg = AutoConfig.from_pretrained(tmp_path / "ext" / "final")
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 4.0


def test_dp2_cp2_runs(tmp_path, packed):
    """4 processes: 2 data-parallel groups of 2 context-parallel ranks, sparse MTraining attention."""
    returncode, out = run_mtrain(4, "train", str(_recipe(tmp_path, packed, "dpcp", max_steps=2, save_every=0,
                                                         grad_accum=1, micro_batch_size=1)),
                                 "--set", "parallel.cp_size=2", "--set", "attention.kind=mtraining",
                                 "--set", "attention.block_size=32", "--set", "attention.sparse_policy=always",
                                 "--set", "parallel.granularity=32")
    assert returncode == 0, out
    rows = [json.loads(line) for line in (tmp_path / "dpcp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["tokens"] for r in rows] == [2 * SEQ, 4 * SEQ]  # 2 DP groups x 1 sequence per step
    assert all(0 < r["attention_density"] <= 1 for r in rows)
    assert all(r["imbalance_step"] >= 1.0 and r["imbalance_worker"] >= 1.0 for r in rows)


def test_cp2_gather_schedule_gives_the_ring_loss(tmp_path, packed):
    """parallel.schedule gather (sparse layers over the group's all-gathered K/V in one call) trains the same model
    as the ring: CP=2, sparse MTraining layers with packed documents, gradient checkpointing (the recomputed layer
    replays its first forward's path and gathers again), every step's loss within 1e-5 (relative; the two sum the
    same terms in another order) and the same attention density."""
    runs = {}
    for schedule in ("ring", "gather"):
        returncode, out = run_mtrain(2, "train", str(_recipe(tmp_path, packed, schedule, max_steps=3, save_every=0,
                                                             export=False)),
                                     "--set", "parallel.cp_size=2", "--set", "attention.kind=mtraining",
                                     "--set", "attention.block_size=32", "--set", "attention.sparse_policy=always",
                                     "--set", "parallel.granularity=32", "--set", f"parallel.schedule={schedule}",
                                     "--set", "logging.log_every=1", "--set", "model.gradient_checkpointing=true")
        assert returncode == 0, out[-3000:]
        runs[schedule] = [json.loads(line) for line in (tmp_path / schedule / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in runs["gather"]] == [r["step"] for r in runs["ring"]] == [1, 2, 3]
    for ring, gather in zip(runs["ring"], runs["gather"]):
        assert abs(gather["loss"] - ring["loss"]) <= 1e-5 * abs(ring["loss"]), (ring, gather)
        assert gather["attention_density"] == pytest.approx(ring["attention_density"], rel=1e-6)
        assert gather["attention_density"] < 1


def _run_deepspeed(tmp_path, recipe, *overrides, cp: int = 2):
    """CP=cp ranks (forked as torchrun would start them, tests/ranks.py) under DeepSpeed ZeRO-2 on the CPU
    (DS_ACCELERATOR=cpu for the ranks only)."""
    return run_mtrain(cp, "train", str(recipe), "--set", f"parallel.cp_size={cp}",
                      "--set", f"train.deepspeed={REPO / 'configs' / 'deepspeed' / 'zero2.json'}", *overrides,
                      env={"DS_ACCELERATOR": "cpu"})


# slow: ~19 s on 2 cores; the quick suite runs DeepSpeed in test_deepspeed_skips_and_counts_non_finite_updates and the
# DDP curve in test_train_resume_export
@pytest.mark.slow
def test_deepspeed_zero2_cp2_gives_the_ddp_loss_curve(tmp_path, packed):
    """The same CP=2 run under DeepSpeed ZeRO-2 (CPU accelerator, gloo) follows the committed DDP curve.

    The first DeepSpeed run on a machine JIT-compiles its CPU communication op (about 100 s, cached after).
    """
    recipe = _recipe(tmp_path, packed, "ds", save_every=0, export=False)
    returncode, out = _run_deepspeed(tmp_path, recipe)
    assert returncode == 0, out
    assert "DP 1 x CP 2, DeepSpeed ZeRO-2, attention dense" in out, out[-2000:]
    losses = _losses(tmp_path / "ds")
    rows = [json.loads(line) for line in (tmp_path / "ds" / "metrics.jsonl").read_text().splitlines()]
    # the gradient norm and the applied updates are read back from the DeepSpeed engine
    assert all(r["grad_norm"] > 0 and r["skipped_steps"] == 0 for r in rows), rows
    golden = {int(k): v for k, v in json.loads(GOLDEN.read_text()).items()}
    assert sorted(losses) == sorted(golden)
    for step, loss in losses.items():  # ZeRO-2 shards the same fp32 AdamW update: equal up to rounding
        assert abs(loss - golden[step]) <= 1e-4 * abs(golden[step]), (step, loss, golden[step])


@pytest.mark.slow
def test_deepspeed_zero2_cp4_gives_the_cp1_loss(tmp_path, packed):
    """Four processes share every sequence (CP=4, block-stripe ring, documents masked across the shards) under
    DeepSpeed ZeRO-2: the loss of every step is CP=1's (one process, no DeepSpeed) within the ZeRO-2 test's
    tolerance."""
    from mtrain.config import load_recipe
    from mtrain.train.trainer import Trainer

    before = torch.are_deterministic_algorithms_enabled()
    try:
        Trainer(load_recipe(_recipe(tmp_path, packed, "cp1", max_steps=3, save_every=0, export=False))).run()
    finally:  # train.deterministic switches torch's flag on for the whole process: leave it as it was
        torch.use_deterministic_algorithms(before)
    recipe = _recipe(tmp_path, packed, "cp4", max_steps=3, save_every=0, export=False)
    returncode, out = _run_deepspeed(tmp_path, recipe, cp=4)
    assert returncode == 0, out[-3000:]
    assert "DP 1 x CP 4, DeepSpeed ZeRO-2, attention dense" in out, out[-2000:]
    want, got = _losses(tmp_path / "cp1"), _losses(tmp_path / "cp4")
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for step, loss in got.items():
        assert abs(loss - want[step]) <= 1e-4 * abs(want[step]), (step, loss, want[step])


@pytest.mark.slow
def test_deepspeed_skips_and_counts_non_finite_updates(tmp_path, packed):
    """An absurd learning rate blows the weights up after the first update: every later step's loss and
    gradients are non-finite, DeepSpeed skips those updates and the trainer counts them."""
    recipe = _recipe(tmp_path, packed, "ds-bad", max_steps=3, save_every=0, export=False, grad_accum=1)
    returncode, out = _run_deepspeed(tmp_path, recipe, "--set", "optim.lr=1e30", "--set", "optim.warmup_steps=0",
                                     "--set", "optim.grad_clip=0")
    assert returncode == 0, out
    rows = [json.loads(line) for line in (tmp_path / "ds-bad" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows] == [0, 1, 2], rows
    assert "update skipped (2 so far)" in out


def _plant_in_zero_partition(ckpt: Path, marker: Path) -> Path:
    """Add a payload to rank 0's ZeRO-2 optimizer partition (the rest of it intact) and rewrite files.json to vouch
    for it, as a sender of the checkpoint could. Returns the planted file."""
    import deepspeed  # noqa: F401  (load_tensors allows DeepSpeed's classes once it is imported)

    from mtrain.safe_load import load_tensors
    from mtrain.train.run_folder import write_file_list

    planted = ckpt / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = load_tensors(planted)
    state["ds_version"] = Payload(marker)
    torch.save(state, planted)
    (ckpt / "files.json").unlink()
    write_file_list(ckpt)
    return planted


@pytest.mark.slow
@pytest.mark.timeout(1800)  # three DeepSpeed launches; the first offload run on a machine also compiles cpu_adam
@pytest.mark.parametrize("config", ["zero2.json", "zero2-offload.json"])
def test_deepspeed_zero2_checkpoints_load_tensors_only(tmp_path, packed, config):
    """Real ZeRO-2 checkpoints (CPU, gloo; with and without optimizer offload) resume and export through the
    tensors-only check; a payload planted in a ZeRO partition is refused by resume (which falls back to the previous
    checkpoint) and by export, and never runs. DeepSpeed itself unpickles these files with weights_only=False."""
    ds = ["--set", f"train.deepspeed={REPO / 'configs' / 'deepspeed' / config}"]
    recipe = _recipe(tmp_path, packed, "ds", max_steps=2, save_every=1, export=False, grad_accum=1)
    returncode, out = _run_deepspeed(tmp_path, recipe, *ds)
    assert returncode == 0, out[-3000:]
    run, marker = tmp_path / "ds", tmp_path / "PWNED"
    planted = _plant_in_zero_partition(run / "checkpoints" / "step-0000002", marker)

    returncode, out = _run_deepspeed(tmp_path, recipe, *ds, "--set", "train.max_steps=3")
    assert not marker.exists(), "code planted in a ZeRO partition ran on resume"
    assert returncode == 0, out[-3000:]
    assert f"step-0000002 is damaged: {planted}: holds a pickled object" in out
    assert "resumed from the previous intact checkpoint" in out and "resumed from" in out
    assert "weights_only" not in out
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]

    # the intact step-3 checkpoint exports; planted, it is refused in one line (`python -m mtrain export`, forked from
    # the CLI's server: tests/ranks.py run_cli)
    proc = run_cli("export", str(run), "--out", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    planted = _plant_in_zero_partition(run / "checkpoints" / "step-0000003", marker)
    proc = run_cli("export", str(run), "--out", str(tmp_path / "hf2"))
    assert not marker.exists(), "code planted in a ZeRO partition ran on export"
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mtrain ")]
    assert len(lines) == 1 and str(planted) in lines[0] and "holds a pickled object" in lines[0], proc.stderr[-3000:]
    assert "weights_only" not in proc.stderr and "Traceback" not in proc.stderr


def _auto_policy_run(tmp_path: Path, packed: Path, out: str, world: int, policy: str = "auto"):
    """`mtrain train` of the sparse kind under sparse_policy `policy` (auto: with dense holds; the stand-in cost model
    of tests/workers/auto_policy_train.py runs every layer sparse and finds the estimate paid on some), CP = world:
    `python SCRIPT` (world 1) or its ranks as torchrun starts them, forked (tests/ranks.py start); returns at once."""
    recipe = _recipe(tmp_path, packed, out, max_steps=8, save_every=4, grad_accum=1, micro_batch_size=1, export=False)
    sets = ["attention.kind=mtraining", f"attention.sparse_policy={policy}", "attention.dense_hold_steps=1",
            "attention.block_size=64", "attention.recall=0.8", "attention.last_q=32", "parallel.granularity=64",
            f"parallel.cp_size={world}", "logging.log_every=1"]
    args = [a for s in sets for a in ("--set", s)]
    return start(world, "tests/workers/auto_policy_train.py", "train", str(recipe), *args, launcher=world > 1)


def _steps(run: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock figures."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "tflops")} for r in rows]


@pytest.mark.slow  # about 2 minutes each on 2 cores: three runs of 8 steps
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("policy", ["auto", "always"])
def test_sparse_resume_is_bit_identical(tmp_path, packed, world, policy):
    """mtraining under sparse_policy auto with dense holds active, and under always: killed (kill -9) after the
    step-4 checkpoint and rerun, the run logs what the uninterrupted one does, bit for bit: losses, per-layer paths,
    held layers, densities. The holds and the lagged choice's statistics are saved with the checkpoint."""
    returncode, out = _finish(_auto_policy_run(tmp_path, packed, "full", world, policy))
    assert returncode == 0, out[-3000:]
    ref = _steps(tmp_path / "full")
    assert [r["step"] for r in ref] == list(range(1, 9))
    if policy == "auto":
        # the policy really moves: layers held dense after step 4 (state the resumed run must restore), sparse too
        assert any(r.get("attention_held_layers", 0) > 0 for r in ref[4:]), ref
        assert any("s" in r["attention_paths"] for r in ref[4:]), ref
    else:  # every layer sparse on every step, none held
        assert all(set(r["attention_paths"]) == {"s"} for r in ref), ref
        assert not any(r.get("attention_held_layers", 0) for r in ref), ref

    _kill_after_checkpoint(_auto_policy_run(tmp_path, packed, "killed", world, policy),
                           tmp_path / "killed" / "checkpoints" / "latest", "step-0000004")
    returncode, out = _finish(_auto_policy_run(tmp_path, packed, "killed", world, policy))
    assert returncode == 0, out[-3000:]
    assert "resumed from" in out
    assert _steps(tmp_path / "killed") == ref


def test_rerun_from_the_saved_config_alone_is_bit_identical_cp2_gather(tmp_path, packed):
    """A run's config.yaml reproduces it: CP=2, the mtraining kind on the gathered schedule with switches away from
    their defaults (given on the command line, so only config.yaml carries them), trained again from that file alone
    into the same folder gives the same loss and gradient norm at every step, to the last bit."""
    import shutil

    out = tmp_path / "first"
    returncode, log = run_mtrain(2, "train", str(_recipe(tmp_path, packed, "first", max_steps=3, save_every=0,
                                                          export=False)),
                                 "--set", "parallel.cp_size=2", "--set", "attention.kind=mtraining",
                                 "--set", "attention.block_size=32", "--set", "attention.sparse_policy=always",
                                 "--set", "parallel.granularity=32", "--set", "parallel.schedule=gather",
                                 "--set", "parallel.fused_merge=false", "--set", "parallel.list_free_columns=false",
                                 "--set", "attention.sample_blocks=4", "--set", "logging.log_every=1")
    assert returncode == 0, log[-3000:]
    import yaml

    saved = shutil.copy(out / "config.yaml", tmp_path / "saved.yaml")
    config = yaml.safe_load(open(saved))
    assert config["parallel"]["schedule"] == "gather" and config["parallel"]["fused_merge"] is False
    assert config["parallel"]["list_free_columns"] is False and config["attention"]["sample_blocks"] == 4
    first = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out)
    returncode, log = run_mtrain(2, "train", str(saved))
    assert returncode == 0, log[-3000:]
    again = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in first] == [r["step"] for r in again] == [1, 2, 3]
    for a, b in zip(first, again):
        assert (a["loss"], a["grad_norm"], a["attention_density"]) == (b["loss"], b["grad_norm"],
                                                                       b["attention_density"]), (a, b)

"""The training loop: model, packed data, AdamW + schedule, checkpoints, metrics; launched by accelerate.

Every stateful thing (model, optimizer, scheduler, data cursor, RNG, counters) is saved together in one
checkpoint folder; rerunning the same command resumes from the `latest` marker.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mtrain.config import RecipeConfig
from mtrain.errors import ConfigError, DamagedCheckpointError, MtrainError, os_error_line
from mtrain.safe_load import check_checkpoint_files
from mtrain.train.loss import ChunkedLossLM
from mtrain.train.memory_record import MemoryRecord
from mtrain.train.memory_record import wanted as memory_record_wanted
from mtrain.train.step_profile import StepProfile
from mtrain.train.step_profile import wanted as profile_step_wanted
from mtrain.train.metrics import MetricsLogger, usable_wandb_mode
from mtrain.train.run_folder import (RunLock, architecture, architecture_mismatch, check_resumable,
                                     checkpoint_candidates, verify_file_list, write_file_list)
from mtrain.train.schedule import lr_factor, warmup_steps

log = logging.getLogger(__name__)

LATEST = "latest"


@dataclass
class TrainState:
    """Counters saved with every checkpoint."""

    step: int = 0
    tokens: int = 0
    bad_steps: int = 0
    dp_size: int = 1
    cp_size: int = 1

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        """The counters `state` holds (those it lacks, from a checkpoint written before they existed, keep their
        defaults); TypeError unless each is a whole number >= 0, as state_dict wrote it."""
        bad = {k: v for k, v in state.items() if k in self.__dict__ and (type(v) is not int or v < 0)}
        if bad:
            raise TypeError(f"counters must be whole numbers >= 0, got {bad}")
        self.__dict__.update({k: v for k, v in state.items() if k in self.__dict__})


@dataclass
class _Loop:
    """What the steps of one run share, made by `Trainer._start_loop` and dropped when `Trainer.run` returns (the
    Trainer keeps no model after its run): the accelerator and what it prepared, the LR scheduler, the metrics
    logger, the progress bar, the reader's iterator, and, while they run, the first step's memory record and the
    profiled step's profiler."""

    accelerator: Any
    model: Any  # the prepared ChunkedLossLM
    optimizer: Any  # the prepared AdamW
    scheduler: Any
    metrics: MetricsLogger
    previous_sigterm: Any  # the SIGTERM handler before the run's, put back when the loop ends
    flops_per_token: float
    world: int  # processes
    device: torch.device
    bar: Any
    it: Iterator  # the reader's iterator (a new one each epoch)
    offload: Callable  # train.offload_activations: OffloadActivations, else a context that does nothing
    profile_at: int  # the step to profile (1-based; 0 = none)
    record: MemoryRecord | None = None
    profiler: StepProfile | None = None


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


# what a launcher (accelerate launch, torchrun, deepspeed) sets; without all of them DeepSpeed looks for MPI instead
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def check_deepspeed_launch(ds_file: str) -> None:
    """A DeepSpeed run started without a launcher finds its processes through MPI (mpi4py): without mpi4py it would
    stop deep inside DeepSpeed, after the model is built, with a bare ModuleNotFoundError. Say how to launch it."""
    if all(name in os.environ for name in LAUNCHER_VARS):
        return
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        launch = ("accelerate launch --config_file configs/accelerate/1gpu.yaml" if torch.cuda.is_available()
                  else "DS_ACCELERATOR=cpu accelerate launch --config_file configs/accelerate/cpu.yaml")
        raise MtrainError(
            f"train.deepspeed ({ds_file}) needs a launcher: this process was started without one ("
            f"{', '.join(n for n in LAUNCHER_VARS if n not in os.environ)} unset) and mpi4py, DeepSpeed's other way "
            f"to find its processes, is not installed; start it with `{launch} "
            "recipes/train.py RECIPE` (see configs/accelerate/), or set train.deepspeed=null for a one-process run "
            "without DeepSpeed") from None


def git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] document ids of packed rows: a new document where position_ids restart at 0."""
    return torch.cumsum((position_ids == 0).long(), dim=-1)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool: causal and within one document (documents start where position_ids == 0)."""
    doc = document_ids(position_ids)
    same_doc = doc[:, :, None] == doc[:, None, :]
    s = position_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=position_ids.device).tril()
    return (same_doc & causal)[:, None]


class Trainer:
    """Runs `recipe` to `train.max_steps`, resuming from OUTPUT_DIR/checkpoints/latest if present."""

    def __init__(self, recipe: RecipeConfig):
        self.recipe = recipe
        self.out = Path(recipe.train.output_dir)
        self._stop_requested = False
        self.stop_signal: int | None = None
        """The signal that stopped the run early (after a checkpoint), for the exit code; None otherwise."""

    def close(self) -> None:
        """Release the run folder's lock (process exit does this too)."""
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.release()

    # ---- set-up -------------------------------------------------------------------------------
    def _accelerator(self):
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs

        handlers, cpu = [], False
        distributed_cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
        if distributed_cpu:
            # accelerate on CPU: gloo, and cpu=True for plain DDP (without it accelerate reports no
            # distribution and reduces nothing); cpu=True would disable DeepSpeed, which runs on gloo as is.
            handlers.append(InitProcessGroupKwargs(backend="gloo"))
        plugin = None
        # DeepSpeed comes from the recipe (train.deepspeed) or from an accelerate config that names a file;
        # either way mtrain fills the batch/clip/precision fields so they always agree with the recipe.
        ds_file = self.recipe.train.deepspeed or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if ds_file and ds_file != "none":
            from mtrain.train.extensions import clear_stale_locks

            clear_stale_locks()  # a killed build of DeepSpeed's CPU ops would otherwise hang this start
            plugin = self._deepspeed_plugin(ds_file)
        elif distributed_cpu:
            cpu = True
        return Accelerator(
            gradient_accumulation_steps=self.recipe.train.grad_accum,
            kwargs_handlers=handlers,
            deepspeed_plugin=plugin,
            cpu=cpu,
            mixed_precision="no",
        )

    def _deepspeed_plugin(self, ds_file: str):
        from accelerate.utils import DeepSpeedPlugin

        t = self.recipe.train
        try:
            ds = json.loads(Path(ds_file).read_text())
        except (OSError, ValueError) as exc:
            raise MtrainError(f"DeepSpeed config '{ds_file}' cannot be read as JSON: {exc}") from None
        check_deepspeed_launch(ds_file)
        ds["train_micro_batch_size_per_gpu"] = t.micro_batch_size
        ds["gradient_accumulation_steps"] = t.grad_accum
        ds["gradient_clipping"] = self.recipe.optim.grad_clip
        ds.pop("train_batch_size", None)
        ds["bf16"] = {"enabled": self.recipe.model.dtype == "bfloat16"}
        ds["fp16"] = {"enabled": self.recipe.model.dtype == "float16"}
        return DeepSpeedPlugin(hf_ds_config=ds)

    def _attn_implementation(self) -> str:
        """transformers' own sdpa/eager (document masks as 4D masks), or the mtrain kind of the run's attention
        runtime (registered with HF when the runtime was made: `_attention_runtime`)."""
        kind = self.recipe.attention.kind
        return kind if kind in ("sdpa", "eager") else self.runtime.name

    def _attention_runtime(self):
        """The attention runtime the run's model owns (`mtrain.models.runtime`): the recipe's attention settings and
        switches (`mtrain.models.registry.recipe_runtime`); for transformers' own kinds one that only carries the
        step's documents and an empty policy state (what the checkpoints hold either way)."""
        from mtrain.models.registry import recipe_runtime
        from mtrain.models.runtime import AttentionRuntime, AttentionSettings
        from mtrain.ops.switches import from_recipe

        kind = self.recipe.attention.kind
        if kind in ("sdpa", "eager"):
            return AttentionRuntime(AttentionSettings(kind=kind, switches=from_recipe(self.recipe)))
        return recipe_runtime(self.recipe)

    def _optimizer(self, model):
        o = self.recipe.optim
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps)

    def _scheduler(self, optimizer, step: int = 0):
        """The LR schedule at `step`, from this recipe's optim settings, which are (re)applied to the optimizer.

        The schedule is a function of the step, so nothing of it is saved: a resume with changed optim
        settings applies them from the resumed step on (and config.yaml records them).
        """
        o, t = self.recipe.optim, self.recipe.train
        warm = warmup_steps(t.max_steps, o.warmup_steps, o.warmup_ratio)

        def factor(step: int) -> float:
            return lr_factor(step, t.max_steps, schedule=o.schedule, warmup=warm,
                             min_ratio=o.min_lr_ratio, start_ratio=o.min_lr_ratio)

        for i, group in enumerate(optimizer.param_groups):
            group.update(lr=o.lr, initial_lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay if i == 0 else 0.0)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=step - 1)

    # ---- checkpoints --------------------------------------------------------------------------
    def _checkpoint_root(self) -> Path:
        return self.out / "checkpoints"

    def _resume(self, accelerator) -> Path | None:
        """Load the newest intact checkpoint: the one `latest` names, else (reported) the previous intact one.

        An intact checkpoint this launch cannot load (another process count, another model) is refused at once,
        naming what differs: it is not damaged, and an older one would not fit either."""
        candidates = checkpoint_candidates(self._checkpoint_root())
        damaged = []
        for path in candidates:
            try:
                verify_file_list(path)
                check_resumable(path, accelerator.num_processes, self.architecture, self.model_key)
                self._load_checkpoint(accelerator, path)
            except DamagedCheckpointError as exc:
                log.warning("checkpoint %s is damaged: %s", path, exc)
                damaged.append(f"{path.name} ({exc})")
                continue
            if damaged:
                log.warning("resumed from the previous intact checkpoint %s instead of damaged %s", path, damaged[0])
            return path
        if damaged:
            raise DamagedCheckpointError(
                f"no intact checkpoint in {self._checkpoint_root()}: {damaged[0]}; restore it, or move "
                f"{self._checkpoint_root()} away to start over"
            )
        return None

    def _saved_optim(self, path: Path) -> dict:
        import yaml

        try:
            return (yaml.safe_load((path / "config.yaml").read_text()) or {}).get("optim") or {}
        except (OSError, yaml.YAMLError, AttributeError):
            return {}

    def _save_checkpoint(self, accelerator) -> None:
        name = f"step-{self.state.step:07d}"
        root = self._checkpoint_root()
        final, tmp = root / name, root / (name + ".tmp")
        try:
            if accelerator.is_main_process:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
            accelerator.wait_for_everyone()
            accelerator.save_state(str(tmp))
            (tmp / f"trainer_state_rank{accelerator.process_index}.json").write_text(
                json.dumps({"state": self.state.state_dict(), "data": self.reader.state_dict(),
                            "attention": self.runtime.state_dict()})
            )
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                self.recipe.save(tmp / "config.yaml")
                (tmp / "meta.json").write_text(json.dumps({
                    "git_revision": git_revision(), "step": self.state.step, "processes": accelerator.num_processes,
                    "dp_size": self.state.dp_size, "cp_size": self.state.cp_size, "model": self.architecture}))
                write_file_list(tmp)
        except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as a RuntimeError
            shutil.rmtree(tmp, ignore_errors=True)
            free = shutil.disk_usage(root).free if root.exists() else -1
            reason = os_error_line(exc) if isinstance(exc, OSError) else f"{tmp}: {' '.join(str(exc).split())[:200]}"
            raise MtrainError(f"writing checkpoint {tmp} failed ({reason}); {free / 2**30:.2f} GiB free there; "
                              f"the previous checkpoint is untouched: free space and rerun to resume") from None
        if accelerator.is_main_process:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            marker_tmp = root / (LATEST + ".tmp")
            marker_tmp.write_text(name)
            os.replace(marker_tmp, root / LATEST)  # written last: a checkpoint exists only once this lands
            log.info("saved checkpoint %s", final)
        accelerator.wait_for_everyone()

    def _load_checkpoint(self, accelerator, path: Path) -> None:
        # Nothing executable is read: weights are safetensors, optimizer and RNG states load with
        # torch.load(weights_only=True), the LR schedule is rebuilt from the step, counters are JSON. DeepSpeed's
        # load_checkpoint unpickles its ZeRO files with weights_only=False: every torch file of the folder is
        # loaded tensors-only first, so a planted object is refused (DamagedCheckpointError) before that.
        check_checkpoint_files(path)
        try:
            saved = json.loads((path / f"trainer_state_rank{accelerator.process_index}.json").read_text())
            state = saved["state"]
            written = (state["dp_size"], state["cp_size"])
        except Exception as exc:  # a missing, torn or foreign counters file
            raise DamagedCheckpointError(f"cannot load it ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
        if written != (self.state.dp_size, self.state.cp_size):
            raise MtrainError(
                f"checkpoint {path} was written with dp_size={state['dp_size']} cp_size={state['cp_size']}, "
                f"this run has dp_size={self.state.dp_size} cp_size={self.state.cp_size}; launch with the same "
                "number of processes and parallel.cp_size, or start a new train.output_dir"
            )
        try:
            accelerator.load_state(str(path))
        except Exception as exc:  # safetensors and the unpickler each fail their own way on a bad file
            mismatch = architecture_mismatch(exc)
            if mismatch is not None:  # intact weights of another model (a checkpoint from before meta.json said so)
                raise MtrainError(f"checkpoint {path} holds a model of another architecture than this run's "
                                  f"{self.model_key} ({mismatch}): resume with the model the run was started with, "
                                  "or start a new run (another train.output_dir)") from None
            raise DamagedCheckpointError(f"cannot load it ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
        state_file = path / f"trainer_state_rank{accelerator.process_index}.json"
        try:  # counters, data cursor and attention holds: a hand-edited file fails here, named
            self.state.load_state_dict(state)
            self.reader.load_state_dict(saved["data"])
            if "attention" in saved:  # checkpoints from before it was saved resume with fresh holds
                self.runtime.load_state_dict(saved["attention"])
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise MtrainError(f"{state_file}: not a trainer state as mtrain writes it ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:200]}); restore the file, or resume from an earlier "
                              f"checkpoint by writing its name (e.g. step-0000010) into {path.parent / LATEST}"
                              ) from None
        log.info("resumed from %s at step %d", path, self.state.step)

    # ---- the loop -----------------------------------------------------------------------------
    def _on_sigterm(self, signum, frame) -> None:
        log.warning("SIGTERM: checkpointing after this step, then stopping")
        self._stop_requested = True
        self.stop_signal = signum

    def _next_batch(self, it):
        try:
            return next(it), it
        except StopIteration:
            it = iter(self.reader)  # next epoch; the reader's cursor moves to it
            return next(it), it

    def _model_flops_per_token(self, model, seq_len: int) -> float:
        cfg = model.config
        n_params = sum(p.numel() for p in model.parameters())
        n_params -= cfg.vocab_size * cfg.hidden_size  # embedding lookup is not a matmul
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        attn = 6 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * seq_len  # causal: half of 12·L·d·S
        return 6 * n_params + attn

    def _setup_parallel(self, accelerator):
        """The DP x CP mesh, the sequence layout and the attention runtime of this rank (`self.runtime`, its topology
        set). The recipe's switches (`mtrain.ops.switches.from_recipe`) choose the ring's hierarchy here, and travel
        in the runtime, whose attention calls pass them down the stack."""
        from mtrain.models.registry import KINDS, layout_name
        from mtrain.models.runtime import Topology
        from mtrain.parallel import Layout
        from mtrain.ops.switches import from_recipe
        from mtrain.parallel.comm import ring_node_size
        from mtrain.train.mesh import build_mesh

        r = self.recipe
        if r.parallel.cp_size > 1 and r.attention.kind not in KINDS:
            raise MtrainError(f"parallel.cp_size={r.parallel.cp_size} needs a context-parallel attention.kind "
                              f"({', '.join(KINDS)}); '{r.attention.kind}' runs on one rank per sequence")
        # the hierarchical ring's node size (parallel.hierarchy / node_size), or None for the flat ring; with it the
        # layout must know the node size to keep every ring step balanced
        node = ring_node_size(r.parallel.cp_size, switches=from_recipe(r)) if r.parallel.cp_size > 1 else None
        if r.parallel.cp_size > 1:
            log.info("context parallelism: %s over %d ranks (parallel.hierarchy=%s)", "the flat ring" if node is None
                     else f"the hierarchical ring, nodes of {node}", r.parallel.cp_size, r.parallel.hierarchy)
        mesh = build_mesh(accelerator.num_processes, accelerator.process_index, r.parallel.cp_size, node)
        layout = Layout.create(layout_name(r), world_size=mesh.cp_size, granularity=r.parallel.granularity,
                               local_world_size=node)
        layout.check(r.data.seq_len)
        self.runtime = self._attention_runtime()
        self.runtime.topology = Topology(group=mesh.cp_group, layout=layout, inner_group=mesh.inner_group,
                                         outer_group=mesh.outer_group, local_world_size=node,
                                         schedule=r.parallel.schedule, dense_schedule=r.parallel.dense_schedule)
        return mesh, layout

    def _micro_batch(self, samples: list[dict]) -> dict:
        """Stack samples and keep this CP rank's layout shard (on the CPU; moved to the device per forward).

        For mtrain's attention kinds `doc_ids` holds the whole sample's document ids (every CP rank needs
        all of them); transformers' own kinds get a 4D document mask instead.
        """
        from mtrain.models.registry import KINDS

        r = self.recipe
        batch = {k: torch.stack([s[k] for s in samples]) for k in ("input_ids", "labels", "position_ids")}
        if r.data.document_masking:
            if r.attention.kind in KINDS:
                batch["doc_ids"] = document_ids(batch["position_ids"])
            else:
                batch["attention_mask"] = document_mask(batch["position_ids"])
        if self.mesh.cp_size > 1:
            # labels are already shifted globally, so every shard keeps its own targets
            for key in ("input_ids", "labels", "position_ids"):
                batch[key] = self.layout.shard(batch[key], self.mesh.cp_rank, dim=1)
        return batch

    # ---- the run ------------------------------------------------------------------------------
    def run(self) -> dict:
        """Train to train.max_steps and return the last step's metrics ({} when no step ran).

        The outline: launch this process (`_launch`), build the data, model and optimizer (`_build`), resume from
        the newest intact checkpoint (`_resume_checked`), then run one `_step` per optimizer step until
        train.max_steps or a SIGTERM. Whatever ends the loop, the progress bar, the SIGTERM handler and the metrics
        file are closed. A SIGTERM stops after its step's checkpoint; a run that reached train.max_steps ends with
        the final checkpoint and the export (`_finish`)."""
        t = self.recipe.train
        accelerator = self._launch()
        tokenizer, hf_model, model, base_optimizer, optimizer = self._build(accelerator)
        self._resume_checked(accelerator)
        loop = self._start_loop(accelerator, hf_model, model, optimizer, base_optimizer)
        last = {}
        try:
            while self.state.step < t.max_steps and not self._stop_requested:
                last = self._step(loop)
        except Exception as exc:
            self._stopped_by(loop, exc)
            raise
        finally:
            self._close_loop(loop)
        if self._stop_requested:
            log.warning("stopped by SIGTERM at step %d; rerun the same command to resume", self.state.step)
            return last
        self._finish(accelerator, model, tokenizer)
        return last

    def _launch(self):
        """This process's start, returning its accelerator: the run folder's lock (rank 0: a second run on the folder
        refuses), the seeds, the accelerator (refused when it sees other processes than were launched, or no
        distribution: gradients would not be reduced), the DP x CP mesh with its layout, and fresh counters."""
        t = self.recipe.train
        if int(os.environ.get("RANK", "0")) == 0:  # one lock per launch: a second run on this folder refuses
            self._lock = RunLock(self.out).acquire()
        seed_everything(t.seed, t.deterministic)
        accelerator = self._accelerator()
        world = accelerator.num_processes
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1 and (world != launched or accelerator.distributed_type == "NO"):
            raise MtrainError(f"launched {launched} processes but accelerate sees {world} with distribution "
                              f"'{accelerator.distributed_type}': gradients would not be reduced")
        self.mesh, self.layout = self._setup_parallel(accelerator)
        self.state = TrainState(dp_size=self.mesh.dp_size, cp_size=self.mesh.cp_size)
        return accelerator

    def _build(self, accelerator):
        """The data reader (kept as self.reader), the tokenizer and the model, with the optimizer: returns
        (tokenizer, hf_model, model, base_optimizer, optimizer), model being the `ChunkedLossLM` around hf_model
        and optimizer the AdamW base_optimizer, both prepared by accelerate. Refuses data packed at another
        seq_len, and a tokenizer (the model's or the data's) larger than the embedding."""
        r, t = self.recipe, self.recipe.train
        from mtrain.data import TrainingReader
        from mtrain.models import load_model, load_tokenizer

        self.reader = TrainingReader(r.data.path, dp_rank=self.mesh.dp_rank, dp_size=self.mesh.dp_size, seed=t.seed,
                                     shuffle=r.data.shuffle, document_masking=r.data.document_masking)
        if getattr(self.reader, "seq_len", r.data.seq_len) != r.data.seq_len:
            raise MtrainError(f"data.seq_len={r.data.seq_len} but {r.data.path} was packed at seq_len={self.reader.seq_len}")
        tokenizer = load_tokenizer(r.model)
        hf_model = load_model(r.model, self._attn_implementation(), runtime=self.runtime)
        self.architecture = architecture(hf_model.config)
        self.model_key = (f"model.config {r.model.config}" if r.model.config is not None
                          else f"model.path {r.model.path}")
        self.embedding_rows = check_vocabulary(r, len(tokenizer), hf_model.get_input_embeddings().num_embeddings,
                                               self.reader.manifest)
        model = ChunkedLossLM(hf_model, chunk=t.loss_chunk)
        base_optimizer = self._optimizer(model)
        model, optimizer = accelerator.prepare(model, base_optimizer)
        if accelerator.is_main_process:
            log.info("training on %d process(es): DP %d x CP %d, %s, attention %s", accelerator.num_processes,
                     self.mesh.dp_size, self.mesh.cp_size, _engine_name(accelerator), r.attention.kind)
        return tokenizer, hf_model, model, base_optimizer, optimizer

    def _resume_checked(self, accelerator) -> None:
        """Resume from the newest intact checkpoint (`_resume`), if there is one, and record this run's recipe as
        OUTPUT_DIR/config.yaml (main process). A train.max_steps below the resumed step is refused before the file
        is written; optim settings that differ from the checkpoint's are named in a warning (they apply from the
        resumed step on)."""
        r, t = self.recipe, self.recipe.train
        ckpt = self._resume(accelerator)
        if self.state.step > t.max_steps:
            raise ConfigError(
                f"train.max_steps={t.max_steps} is below step {self.state.step} of checkpoint {ckpt}, which this run "
                f"resumes: nothing would be trained and final/ would hold step {self.state.step}; set train.max_steps "
                f">= {self.state.step} (equal re-exports that step), or give a new train.output_dir to start over")
        if accelerator.is_main_process:  # after the checks: a refused run leaves the folder's config.yaml as it was
            self.out.mkdir(parents=True, exist_ok=True)
            r.save(self.out / "config.yaml")
        if ckpt is not None:
            old = self._saved_optim(ckpt)
            changed = {k: (old[k], v) for k, v in r.to_dict()["optim"].items() if k in old and old[k] != v}
            if changed:
                log.warning("optim settings differ from checkpoint %s and apply from step %d: %s", ckpt.name,
                            self.state.step, ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()))

    def _start_loop(self, accelerator, hf_model, model, optimizer, base_optimizer) -> _Loop:
        """What the steps share, made in this order: the LR scheduler at the resumed step, the metrics logger
        (metrics.jsonl cut back to the steps before it, and wandb), the SIGTERM handler, the model's FLOPs per token,
        the reader's iterator, the model in train mode, the progress bar, the first step's memory record when
        train.memory_record asks for one, the activation offload context and the step to profile."""
        r, t = self.recipe, self.recipe.train
        # The scheduler stays unwrapped (accelerate would step it once per process); it is rebuilt from the step.
        scheduler = self._scheduler(base_optimizer, self.state.step)
        metrics = MetricsLogger(
            self.out, wandb_mode=usable_wandb_mode(r.logging.wandb), project=r.logging.project,
            run_name=r.logging.run_name or self.out.name, config=r.to_dict(), resume_step=self.state.step,
            enabled=accelerator.is_main_process,
        )
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        flops_per_token = self._model_flops_per_token(hf_model, r.data.seq_len)
        it = iter(self.reader)
        model.train()
        from tqdm.auto import tqdm

        bar = tqdm(total=t.max_steps, initial=self.state.step, desc=f"train {self.out.name}", unit="step",
                   disable=not accelerator.is_main_process, dynamic_ncols=True)
        record = None
        if memory_record_wanted(t.memory_record) and self.state.step < t.max_steps:
            record = MemoryRecord(self.out, accelerator.process_index)  # the first step's allocations (GPU only)
        # train.offload_activations: what autograd saves (under checkpointing: each layer's input) waits in host memory
        from mtrain.models.memory import OffloadActivations

        offload = OffloadActivations if t.offload_activations else contextlib.nullcontext
        profile_at = profile_step_wanted(t.profile_step)
        return _Loop(accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler, metrics=metrics,
                     previous_sigterm=previous, flops_per_token=flops_per_token, world=accelerator.num_processes,
                     device=accelerator.device, bar=bar, it=it, offload=offload, profile_at=profile_at, record=record)

    # ---- one step -----------------------------------------------------------------------------
    def _step(self, loop: _Loop) -> dict:
        """One optimizer step, returning its metrics: the step's micro-batches (`_micro_batches`), the attention
        runtime's inputs set for it (`_prepare_context`), their forward and backward (`_forward_backward`), the update
        applied or skipped (`_update`), the LR schedule and the counters moved on, the metrics logged (`_log_step`)
        and, every train.save_every steps or after a SIGTERM, a checkpoint. The step train.profile_step names is
        profiled, its profile written after the step's clock stops; the first step's memory record ends with it."""
        t = self.recipe.train
        if self.state.step + 1 == loop.profile_at:
            loop.profiler = StepProfile(self.out, loop.accelerator.process_index, loop.profile_at)
            loop.profiler.start()
        start = time.perf_counter()
        micro, global_valid, global_tokens = self._micro_batches(loop)
        self._prepare_context()
        loss, grad_norm = self._forward_backward(loop, micro, global_valid)
        grad_norm = self._update(loop, loss, grad_norm)
        lr = loop.scheduler.get_last_lr()[0]  # the LR this step used
        loop.scheduler.step()
        self.state.step += 1
        self.state.tokens += global_tokens
        if loop.record is not None:
            loop.record.finish(f"end of step {self.state.step}")
            loop.record = None
        elapsed = time.perf_counter() - start
        if loop.profiler is not None:  # after the step's clock: writing the profile is not the step's time
            loop.profiler.finish()
            loop.profiler = None
        records = self.runtime.drain()  # what the step's attention calls recorded
        last = self._step_metrics(loop, loss, lr, grad_norm, global_tokens, elapsed, records)
        self._log_step(loop, last, loss, records)
        if (t.save_every and self.state.step % t.save_every == 0) or self._stop_requested:
            self._save_checkpoint(loop.accelerator)
        return last

    def _micro_batches(self, loop: _Loop) -> tuple[list[dict], float, int]:
        """The step's train.grad_accum micro-batches of train.micro_batch_size samples (`_micro_batch`: this CP
        rank's shards, on the CPU) and the counts the step is normalised by, summed over all ranks: returns
        (micro-batches, valid targets (at least 1), tokens (each sequence once, though every CP rank holds it))."""
        t = self.recipe.train
        samples = []
        for _ in range(t.grad_accum * t.micro_batch_size):
            sample, loop.it = self._next_batch(loop.it)
            samples.append(sample)
        micro = [self._micro_batch(samples[i : i + t.micro_batch_size])
                 for i in range(0, len(samples), t.micro_batch_size)]
        local_valid = sum(int((b["labels"] != -100).sum()) for b in micro)
        counts = torch.tensor([local_valid, sum(s["input_ids"].numel() for s in samples)], dtype=torch.float64,
                              device=loop.device)
        counts = loop.accelerator.reduce(counts, reduction="sum")
        # every CP rank counted the whole sample's tokens: count each sequence once
        global_valid, global_tokens = max(1.0, float(counts[0])), int(counts[1]) // self.mesh.cp_size
        return micro, global_valid, global_tokens

    def _prepare_context(self) -> None:
        """Set the attention runtime's inputs for the coming step: the optimizer step (what dense_hold counts),
        whether the step samples recall (every logging.recall_every steps) and whether it measures the ring's
        imbalance (only on the steps that log their metrics). The last step's records were drained when it logged."""
        r, t = self.recipe, self.recipe.train
        inputs = self.runtime.inputs
        inputs.step = self.state.step  # dense_hold counts optimizer steps
        every = r.logging.recall_every
        inputs.sample_recall = bool(every) and (self.state.step + 1) % every == 0
        # the imbalance is logged with the step's metrics: measure it only on the steps that log
        inputs.sample_imbalance = ((self.state.step + 1) % r.logging.log_every == 0
                                   or self.state.step + 1 == t.max_steps)

    def _forward_backward(self, loop: _Loop, micro: list[dict], global_valid: float):
        """Forward and backward of each micro-batch under accelerate's gradient accumulation, the gradients
        clipped to optim.grad_clip when they sync, then the step's loss: the loss summed over every rank's tokens
        over the global count of valid targets. Returns (loss, the norm accelerate's clipping gave, None when no
        micro-batch synced)."""
        r, t = self.recipe, self.recipe.train
        accelerator, model = loop.accelerator, loop.model
        loss_sum_local = torch.zeros((), dtype=torch.float64)
        grad_norm = None
        for cpu_batch in micro:
            batch = self._to_device(loop, cpu_batch)
            with accelerator.accumulate(model):
                with loop.offload():
                    loss_sum, _ = model(batch["input_ids"], batch["position_ids"], batch["labels"],
                                        batch.get("attention_mask"))
                # Normalise by the global count of valid tokens. accelerate divides by grad_accum
                # and DDP / DeepSpeed average over ranks: undo both so the gradient is that of the
                # global token mean (CP ranks' partial gradients add up to the full one).
                scaled = loss_sum * (loop.world * t.grad_accum / global_valid)
                accelerator.backward(scaled)
                loss_sum_local += loss_sum.detach().double().cpu()
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), r.optim.grad_clip or float("inf"))
        loss_total = accelerator.reduce(loss_sum_local.to(loop.device), reduction="sum")
        return float(loss_total) / global_valid, grad_norm

    def _to_device(self, loop: _Loop, cpu_batch: dict) -> dict:
        """A micro-batch on the device for the forward, less its document ids: those set the documents of the
        attention runtime, read here from the CPU batch once (the layers read none). A token id outside the
        embedding (data from a larger tokenizer, packed without a manifest to say so) is refused."""
        r = self.recipe
        top = int(cpu_batch["input_ids"].max())
        if top >= self.embedding_rows:  # data from a tokenizer larger than the embedding (no manifest)
            raise MtrainError(f"data.path {r.data.path}: token id {top} at step {self.state.step + 1} is "
                              f"outside the model's {self.embedding_rows}-row embedding; pack the data "
                              "with the model's tokenizer")
        batch = {k: v.to(loop.device) for k, v in cpu_batch.items() if k != "doc_ids"}
        # the documents' boundaries read here from the CPU batch, once; the layers read none
        self.runtime.set_documents(cpu_batch.get("doc_ids"), loop.device)
        return batch

    def _update(self, loop: _Loop, loss: float, grad_norm) -> float:
        """Apply the step's update, or skip it when the loss or the gradient norm is not finite: a skipped update
        counts in bad_steps, and more than train.max_bad_steps stops the run. Under DeepSpeed, which clips, steps
        and skips non-finite updates inside backward, what it did is read back. Returns the gradient norm as a
        float (nan when none is known)."""
        t = self.recipe.train
        model, optimizer = loop.model, loop.optimizer
        if loop.accelerator.distributed_type == "DEEPSPEED":
            # DeepSpeed clips and steps inside backward and skips an update whose gradients are not
            # finite itself (its overflow check): read back what it did.
            norm = model.get_global_grad_norm()
            grad_norm = float(norm) if norm is not None else float("nan")
            step_ok = model.was_step_applied() and math.isfinite(loss)
        else:
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            step_ok = math.isfinite(loss) and math.isfinite(grad_norm)
        if not step_ok:
            optimizer.zero_grad(set_to_none=True)
            self.state.bad_steps += 1
            log.warning("step %d: non-finite loss/grad (%s, %s), update skipped (%d so far)",
                        self.state.step + 1, loss, grad_norm, self.state.bad_steps)
            if self.state.bad_steps > t.max_bad_steps:
                raise MtrainError(f"{self.state.bad_steps} non-finite steps (train.max_bad_steps="
                                  f"{t.max_bad_steps}); lower optim.lr or check the data")
        else:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _step_metrics(self, loop: _Loop, loss: float, lr: float, grad_norm: float, global_tokens: int,
                      elapsed: float, records) -> dict:
        """The step's metrics as metrics.jsonl records them: step, loss, the LR it used, gradient norm, tokens,
        speed (tokens/s, TFLOP/s per process) and skipped steps; then, from the step's attention records, the mean
        attention density and, when the step measured it, the ring's imbalance (worst worker, worst ring step,
        each CP rank's work over the mean)."""
        last = {
            "step": self.state.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": self.state.tokens,
            "tokens_per_s": global_tokens / elapsed,
            "tflops": loop.flops_per_token * global_tokens / elapsed / loop.world / 1e12,
            "skipped_steps": self.state.bad_steps,
        }
        if records.densities:
            last["attention_density"] = float(sum(records.densities)) / len(records.densities)
        if records.imbalances:
            last["imbalance_worker"] = max(m[0] for m in records.imbalances)
            last["imbalance_step"] = max(m[1] for m in records.imbalances)
            # each CP rank's work over the mean (layer 0; the largest over the step's micro-batches)
            for rank, share in enumerate(map(max, zip(*(m[2] for m in records.imbalances)))):
                last[f"imbalance_rank/r{rank}"] = share
        return last

    def _log_step(self, loop: _Loop, last: dict, loss: float, records) -> None:
        """Log the step's metrics (`last`, updated in place) every logging.log_every steps and at the last step,
        with the per-layer attention summary and every rank's peak memory (a collective: every rank logs the same
        steps), and move the progress bar on."""
        from mtrain.train.metrics import attention_stats

        r, t = self.recipe, self.recipe.train
        if self.state.step % r.logging.log_every == 0 or self.state.step == t.max_steps:
            last.update(attention_stats(records.layers))  # per layer: path, density, recalls
            last.update(_peak_memory(loop.accelerator, loop.device))  # collective: every rank logs the same steps
            loop.metrics.log(last)
        loop.bar.update(1)
        loop.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{last['tokens_per_s']:.0f}")

    # ---- the end of the run -------------------------------------------------------------------
    def _stopped_by(self, loop: _Loop, exc: Exception) -> None:
        """Finish what the step that raised `exc` left open, each noting what stopped it: the first step's memory
        record (e.g. out of memory: where the memory went up to then) and the profile of the profiled step."""
        if loop.record is not None:  # e.g. out of memory: where the memory went up to then
            loop.record.finish(f"step {self.state.step + 1} stopped by {type(exc).__name__}: {str(exc)[:200]}")
        if loop.profiler is not None:
            loop.profiler.finish(f"stopped by {type(exc).__name__}")

    def _close_loop(self, loop: _Loop) -> None:
        """Close the progress bar, put back the SIGTERM handler the run replaced, and close the metrics logger."""
        loop.bar.close()
        signal.signal(signal.SIGTERM, loop.previous_sigterm)
        loop.metrics.close()

    def _finish(self, accelerator, model, tokenizer) -> None:
        """The end of a run that reached train.max_steps: the final checkpoint (unless the last periodic one holds
        this step), the HF export of the model to OUTPUT_DIR/final when train.export, and a barrier so that no
        process leaves before the others are done."""
        from mtrain.models import export_hf

        t = self.recipe.train
        if ckpt_needed(self.state.step, t):
            self._save_checkpoint(accelerator)
        if t.export:
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                export_hf(accelerator.unwrap_model(model).model, tokenizer, self.out / "final")
                log.info("exported HF checkpoint to %s", self.out / "final")
        accelerator.wait_for_everyone()


def check_vocabulary(r: RecipeConfig, tokenizer_size: int, rows: int, manifest: dict | None) -> int:
    """The tokenizer and the packed data's tokenizer fit in the model's embedding (`rows`); returns `rows`.

    A larger tokenizer gives ids past the embedding: the first batch holding one would stop with an IndexError."""
    model_key = f"model.config {r.model.config}" if r.model.config is not None else f"model.path {r.model.path}"
    if tokenizer_size > rows:
        raise ConfigError(f"model.tokenizer {r.model.tokenizer or r.model.path} has {tokenizer_size} tokens but the "
                          f"embedding of {model_key} has {rows} rows; use the tokenizer the model was built with, or "
                          f"a model with vocab_size >= {tokenizer_size}")
    packed = ((manifest or {}).get("tokenizer") or {}).get("vocab_size")
    if packed is not None and int(packed) > rows:
        raise ConfigError(f"data.path {r.data.path} was packed with a {packed}-token tokenizer "
                          f"({manifest['tokenizer'].get('path')}) but the embedding of {model_key} has {rows} rows; "
                          f"pack the data with the model's tokenizer, or use a model with vocab_size >= {packed}")
    return rows


def _peak_memory(accelerator, device) -> dict:
    """Peak GPU memory of every process (GiB, torch's allocator): peak_mem_gb (the largest) and
    peak_mem_gb/rankN for each rank (one small all-gather; every process must call it). {} without a GPU."""
    if not torch.cuda.is_available():
        return {}
    mine = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], dtype=torch.float64, device=device)
    peaks = accelerator.gather(mine).tolist() if accelerator.num_processes > 1 else mine.tolist()
    out = {"peak_mem_gb": max(peaks)}
    if len(peaks) > 1:
        out.update({f"peak_mem_gb/rank{r}": p for r, p in enumerate(peaks)})
    return out


def ckpt_needed(step: int, t) -> bool:
    """Save a final checkpoint unless the last periodic one already covers this step."""
    return step > 0 and not (t.save_every and step % t.save_every == 0)


def _engine_name(accelerator) -> str:
    """How gradients and optimizer state are held, for the start-up line: DeepSpeed ZeRO stage (+ offload) or DDP."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        zero = plugin.deepspeed_config.get("zero_optimization", {})
        device = zero.get("offload_optimizer", {}).get("device", "none")
        offload = f" + optimizer offload ({device})" if device not in (None, "none") else ""
        return f"DeepSpeed ZeRO-{zero.get('stage', 0)}{offload}"
    return "DDP" if accelerator.num_processes > 1 else "one process"

"""Run logging: `metrics.jsonl` (always, one JSON line per optimizer step) and wandb (online/offline/off), and
the per-step summary of sparse attention (`attention_stats`)."""

from __future__ import annotations

import json
import logging
import os
import secrets
from pathlib import Path

from mtrain.atomic import write_text_atomic

log = logging.getLogger(__name__)


class MetricsLogger:
    """Appends metrics to OUTPUT_DIR/metrics.jsonl and mirrors them to wandb when enabled.

    On resume the file is truncated to the steps before the resumed step, so a rerun never leaves
    duplicate or orphaned lines from a crashed attempt.
    """

    def __init__(self, output_dir: str | os.PathLike, *, wandb_mode: str, project: str, run_name: str,
                 config: dict, resume_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._wandb = None
        if not enabled:
            return
        self._truncate_after(resume_step)
        self._file = self.path.open("a", encoding="utf-8")
        if wandb_mode != "disabled":
            if wandb_mode == "offline":
                # offline means no network: wandb's error reporting would still resolve its collector's host name
                # (wandb-core then runs with --no-observability)
                os.environ["WANDB_ERROR_REPORTING"] = "false"
            import wandb

            run_id_file = Path(output_dir) / "wandb_run_id"
            run_id = run_id_file.read_text().strip() if run_id_file.exists() else secrets.token_hex(4)
            run_id_file.write_text(run_id)
            self._wandb = wandb.init(
                project=project, name=run_name, id=run_id, resume="allow", mode=wandb_mode,
                dir=str(output_dir), config=config,
            )

    def _truncate_after(self, resume_step: int) -> None:
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= resume_step:
                    kept.append(line)
            except (ValueError, KeyError):
                continue  # a torn last line from a killed run
        write_text_atomic(self.path, "".join(line + "\n" for line in kept))

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def usable_wandb_mode(mode: str) -> str:
    """`online` needs a wandb API key (WANDB_API_KEY or `wandb login`); without one, log offline and say so.

    Offline runs can be uploaded later with `wandb sync OUTPUT_DIR/wandb/offline-run-*`.
    """
    if mode != "online" or os.environ.get("WANDB_API_KEY"):
        return mode
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        if "api.wandb.ai" in netrc.read_text():
            return mode
    except OSError:
        pass
    log.warning("logging.wandb=online but no wandb API key (WANDB_API_KEY or `wandb login`): logging offline "
                "instead; upload later with `wandb sync OUTPUT_DIR/wandb/offline-run-*`")
    return "offline"


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All complete JSON lines of a metrics.jsonl (a torn final line is ignored)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def attention_stats(records: list) -> dict:
    """Metrics of one step's sparse-kind attention calls (`mtrain.models.context.LayerRecord`s).

    Per layer (NN = layer index; calls of a layer in one step are averaged: micro-batches, recomputation):
    attn_sparse/LNN (share of its calls that ran sparse), attn_density/LNN (estimated pattern's fraction of
    causal pairs; absent where the cost model skipped the estimate), attn_est_recall/LNN (the estimator's own
    figure, when it gives one), attn_true_recall/LNN (sampled exact recall, on logging.recall_every steps),
    attn_output_error/LNN (the quality check's output error, under attention.max_output_error), attn_cap_scale/LNN
    (the multiplier of its caps, where attention.widen_caps widened them: `mtrain.models.policy.widen`),
    attn_layer_recall/LNN (its recall, where attention.escalate_recall raised it: `mtrain.models.policy.escalate`).
    Over all layers: attention_paths (one letter per layer: s = sparse, d = dense, m = mixed),
    attention_held_layers (share of calls run dense under attention.dense_hold_steps without estimating),
    attention_widened_layers (how many layers run with widened caps) and attention_widened_calls (how many calls
    doubled their layer's caps this step) where any did, attention_escalated_layers (layers estimating at
    attention.escalate_recall) where any do,
    attention_index_mib (the largest index of the step on this rank: its block and column lists, MiB),
    attention_sparse_layers (share of sparse calls), attention_work (fraction of causal pairs computed: the
    density on sparse calls, 1 on dense ones), the means of the recalls (true recall also its minimum) and,
    under the cost model, the predicted ms of the chosen paths and of dense everywhere (attention_pred_ms,
    attention_pred_dense_ms).
    """
    if not records:
        return {}
    from mtrain.models.context import records_as_floats

    rows = records_as_floats(records)  # one host read for the step's records
    by_layer: dict = {}
    for i, row in enumerate(rows):
        by_layer.setdefault(row["layer"] if row["layer"] is not None else i, []).append(row)

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    out, paths = {}, []
    for layer in sorted(by_layer, key=lambda x: (not isinstance(x, int), x)):
        calls = by_layer[layer]
        name = f"L{layer:02d}" if isinstance(layer, int) else f"L{layer}"
        sparse_share = mean([1.0 if c["path"] == "sparse" else 0.0 for c in calls])
        paths.append("s" if sparse_share == 1.0 else "d" if sparse_share == 0.0 else "m")
        out[f"attn_sparse/{name}"] = sparse_share
        density = mean([c["density"] for c in calls])
        if density is not None:  # None: never estimated (sparse could not pay)
            out[f"attn_density/{name}"] = density
        for key in ("est_recall", "true_recall", "output_error"):
            value = mean([c[key] for c in calls])
            if value is not None:
                out[f"attn_{key}/{name}"] = value
        scale = mean([c.get("cap_scale", 1) for c in calls])
        if scale != 1:
            out[f"attn_cap_scale/{name}"] = scale
        raised = mean([c.get("escalated_recall") for c in calls])
        if raised is not None:
            out[f"attn_layer_recall/{name}"] = raised
    out["attention_paths"] = "".join(paths)
    if any(r.get("held") for r in rows):  # dense without an estimate: an earlier step's choice holds
        out["attention_held_layers"] = mean([1.0 if r.get("held") else 0.0 for r in rows])
    widened = [layer for layer, calls in by_layer.items() if any(c.get("cap_scale", 1) != 1 for c in calls)]
    if widened or any(r.get("widened") for r in rows):  # wider caps than the recipe's: attention.widen_caps
        out["attention_widened_layers"] = len(widened)
        out["attention_widened_calls"] = sum(1 for r in rows if r.get("widened"))
    escalated = [layer for layer, calls in by_layer.items() if any(c.get("escalated_recall") for c in calls)]
    if escalated:  # layers estimating at attention.escalate_recall
        out["attention_escalated_layers"] = len(escalated)
    largest = max(r.get("index_bytes", 0) for r in rows)
    if largest:  # the lists of the step's largest index (this rank's rows)
        out["attention_index_mib"] = largest / 2**20
    out["attention_sparse_layers"] = mean([1.0 if r["path"] == "sparse" else 0.0 for r in rows])
    out["attention_work"] = mean([r["density"] if r["path"] == "sparse" else 1.0 for r in rows])
    for key in ("est_recall", "true_recall"):
        values = [r[key] for r in rows if r[key] is not None]
        if values:
            out[f"attention_{key}"] = sum(values) / len(values)
    true = [r["true_recall"] for r in rows if r["true_recall"] is not None]
    if true:
        out["attention_true_recall_min"] = min(true)
    predicted = [r for r in rows if r["dense_ms"] == r["dense_ms"]]  # NaN when no prediction was made
    if predicted:
        out["attention_pred_ms"] = sum(r["sparse_ms"] if r["path"] == "sparse" else r["dense_ms"] for r in predicted)
        out["attention_pred_dense_ms"] = sum(r["dense_ms"] for r in predicted)
    return out

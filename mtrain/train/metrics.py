"""Run logging: `metrics.jsonl` (always, one JSON line per optimizer step) and wandb (online/offline/off)."""

from __future__ import annotations

import json
import logging
import os
import secrets
from pathlib import Path

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
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

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


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All complete JSON lines of a metrics.jsonl (a torn final line is ignored)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows

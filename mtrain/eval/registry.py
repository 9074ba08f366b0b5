"""The task registry: every eval task by name, with its family, generation settings, metric and prompt builder.

Task modules register themselves at import; `get_task` / `resolve_tasks` are the lookups the runner uses.
"""

from __future__ import annotations

import fnmatch
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from mtrain.errors import MtrainError


@dataclass
class Sample:
    """One prompt of one task at one length, as token ids, with what scoring needs."""

    index: int
    length: int
    prompt_ids: list[int]
    references: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class BuildContext:
    """What a prompt builder may use: the model's tokenizer, the task's resolved parameters, a memo."""

    tokenizer: Any
    params: dict[str, Any]
    seed: int
    task_name: str
    memo: dict[str, Any] = field(default_factory=dict)

    def rng(self, length: int, index: int) -> random.Random:
        """A generator that depends only on (seed, task, length, index): a sample is rebuilt identically alone."""
        return random.Random(f"{self.seed}/{self.task_name}/{length}/{index}")

    def encode(self, text: str) -> list[int]:
        """Tokenize a whole prompt once; special tokens (a BOS, if the model uses one) only at its start."""
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]


@dataclass(frozen=True)
class Task:
    """A registered eval task.

    kind: "generate" (greedy continuation scored by `metric`) or "loglik" (perplexity over the prompt).
    build(ctx, length, index) -> Sample, for index in range(count(ctx, length, requested)); without `count`
    a task has exactly the requested number of samples. `source` says where the data comes from;
    `check_data(params)` verifies the external files it names exist.
    """

    name: str
    family: str
    kind: str
    metric: str
    max_new_tokens: int
    stop: tuple[str, ...]
    build: Callable[[BuildContext, int, int], Sample]
    version: str = "1"
    source: str = "offline"
    default_params: dict[str, Any] = field(default_factory=dict)
    count: Callable[[BuildContext, int, int], int] | None = None
    check_data: Callable[[dict[str, Any]], None] | None = None  # raises MissingDataError before any model loads

    def num_samples(self, ctx: BuildContext, length: int, requested: int) -> int:
        return self.count(ctx, length, requested) if self.count else requested


TASKS: dict[str, Task] = {}


def register(task: Task) -> Task:
    if task.name in TASKS:
        raise ValueError(f"task {task.name} registered twice")
    TASKS[task.name] = task
    return task


def _load_all() -> None:
    # importing the task modules fills TASKS
    from mtrain.eval.tasks import infbench, niah, pg19, ruler  # noqa: F401


def get_task(name: str) -> Task:
    _load_all()
    if name not in TASKS:
        raise MtrainError(f"unknown eval task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def resolve_tasks(patterns: list[str]) -> list[str]:
    """Expand names and shell-style patterns (`ruler/*`, `infbench/en_*`) to registered task names, in order."""
    _load_all()
    names: list[str] = []
    for pattern in patterns:
        hits = [n for n in TASKS if fnmatch.fnmatchcase(n, pattern)] if any(c in pattern for c in "*?[") else (
            [pattern] if pattern in TASKS else [])
        if not hits:
            raise MtrainError(f"eval task {pattern!r} matches nothing; known tasks: {', '.join(sorted(TASKS))}")
        names += [n for n in hits if n not in names]
    return names

"""Suite files (`eval/*.yaml`): which tasks, at which lengths, how many samples, with which data paths.

Validated at load: an unknown key is a ConfigError naming it. CLI overrides (--tasks/--lengths/--samples) apply here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mtrain.errors import ConfigError
from mtrain.eval.registry import get_task, resolve_tasks

# keys a suite may set at the top level
SUITE_KEYS = {"name", "seed", "lengths", "samples", "data", "backend", "tasks"}
# per-task keys understood by the runner for every task
COMMON_TASK_KEYS = {"lengths", "samples", "max_new_tokens", "stop"}
# data paths (top-level `data:` or per task) read by tasks that need external files
DATA_KEYS = {"essay_path", "squad_path", "hotpotqa_path", "pg19_path", "infbench_dir"}


@dataclass
class TaskRun:
    """One task of a suite, fully resolved: lengths, samples per length, generation settings, parameters."""

    name: str
    lengths: list[int]
    samples: int
    max_new_tokens: int
    stop: list[str]
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class Suite:
    name: str
    seed: int
    tasks: list[TaskRun]
    backend: dict[str, Any] = field(default_factory=dict)


def _ints(value: Any, key: str) -> list[int]:
    values = value if isinstance(value, list) else [value]
    try:
        out = [int(v) for v in values]
    except (TypeError, ValueError):
        raise ConfigError(f"suite key {key!r} must be a list of integers, got {value!r}") from None
    if not out or min(out) <= 0:
        raise ConfigError(f"suite key {key!r} must hold positive integers, got {value!r}")
    return out


def parse_suite(raw: dict, *, tasks: list[str] | None = None, lengths: list[int] | None = None,
                samples: int | None = None) -> Suite:
    """Resolve a suite mapping (as loaded from YAML) plus CLI overrides into TaskRuns.

    `tasks` patterns select among the suite's tasks (a task absent from the suite runs with its defaults);
    `lengths` and `samples` replace every task's values (for `niah`, samples = haystacks per grid cell;
    tasks reading files run at most as many samples as the file holds).
    """
    bad = set(raw) - SUITE_KEYS
    if bad:
        raise ConfigError(f"unknown suite key(s) {sorted(bad)}; allowed: {sorted(SUITE_KEYS)}")
    data = dict(raw.get("data") or {})
    bad = set(data) - DATA_KEYS
    if bad:
        raise ConfigError(f"unknown data key(s) {sorted(bad)} under 'data'; allowed: {sorted(DATA_KEYS)}")
    default_lengths = _ints(raw.get("lengths", [4096]), "lengths")
    default_samples = int(raw.get("samples", 10))
    entries: dict[str, dict] = {}
    for pattern, params in (raw.get("tasks") or {}).items():
        for name in resolve_tasks([pattern]):
            # an exact entry refines what a pattern entry set
            entries[name] = {**entries.get(name, {}), **(params or {})}
    names = list(entries)
    if tasks:
        names = resolve_tasks(tasks)
    if not names:
        raise ConfigError("the suite selects no task; add entries under 'tasks' or pass --tasks")
    runs = []
    for name in names:
        task = get_task(name)
        given = entries.get(name, {})
        allowed = COMMON_TASK_KEYS | DATA_KEYS | set(task.default_params)
        bad = set(given) - allowed
        if bad:
            raise ConfigError(f"unknown key(s) {sorted(bad)} for task {name}; allowed: {sorted(allowed)}")
        params = {**task.default_params, **data, **{k: v for k, v in given.items() if k not in COMMON_TASK_KEYS}}
        task_lengths = lengths or _ints(given.get("lengths", default_lengths), f"tasks.{name}.lengths")
        if samples is not None and name == "niah":
            params["haystacks"] = samples
        n = int(samples or given.get("samples", default_samples))
        max_new = int(given.get("max_new_tokens", task.max_new_tokens))
        if min(task_lengths) <= max_new:
            raise ConfigError(f"task {name}: length {min(task_lengths)} leaves no room for a prompt beside "
                              f"max_new_tokens {max_new}; drop that length or lower tasks.{name}.max_new_tokens")
        runs.append(TaskRun(name=name, lengths=sorted(task_lengths), samples=n, max_new_tokens=max_new,
                            stop=list(given.get("stop", task.stop)), params=params))
    return Suite(name=str(raw.get("name", "suite")), seed=int(raw.get("seed", 0)), tasks=runs,
                 backend=dict(raw.get("backend") or {}))


def load_suite(path: str, **overrides) -> Suite:
    """Read a suite YAML and resolve it (see `parse_suite` for the overrides)."""
    import yaml

    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"suite file {path!r} not found; the suites shipped are in eval/ (tiny.yaml, paper.yaml)") \
            from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"suite file {path!r} is not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"suite file {path!r} must be a mapping of {sorted(SUITE_KEYS)}")
    return parse_suite(raw, **overrides)

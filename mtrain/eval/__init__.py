"""The eval stage: RULER, needle-in-a-haystack, PG-19 perplexity and InfiniteBench on any HF checkpoint folder.

Public API: load_suite / parse_suite, run_suite, score_run / score_records, make_backend, get_task, TASKS.
"""

from mtrain.eval.registry import TASKS, Sample, Task, get_task, resolve_tasks
from mtrain.eval.runner import make_backend, run_suite
from mtrain.eval.scoring import score_records, score_run
from mtrain.eval.suite import Suite, TaskRun, load_suite, parse_suite

__all__ = [
    "TASKS", "Sample", "Task", "Suite", "TaskRun", "get_task", "resolve_tasks", "make_backend", "run_suite",
    "score_records", "score_run", "load_suite", "parse_suite",
]

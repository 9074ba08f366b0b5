"""Needle-in-a-haystack: a lengths x depths grid, several haystacks per cell, greedy, score = answer found.

Sample index -> (depth, haystack): index = depth_idx * haystacks + rep; each rep shifts the haystack and the needle.
"""

from __future__ import annotations

from mtrain.errors import MtrainError
from mtrain.eval.registry import BuildContext, Sample, Task, register
from mtrain.eval.tasks.haystack import needle_prompt
from mtrain.eval.text import check_essays, key_word, number_value, uuid_value

DEFAULTS = {
    "depths": [0, 25, 50, 75, 100],  # percent of the haystack before the needle
    "haystacks": 3,  # haystacks (and needles) per (length, depth) cell
    "haystack": "essay",  # essay (essay_path: files, or "synthetic") | noise
    "value": "number",  # number (7 digits) | uuid
    "needle": "The special magic number for {key} is: {value}.",
    "template": "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the number afterwards.\n{context}\n"
    "What is the special magic number for {key} mentioned in the provided text?",
    "answer_prefix": " The special magic number for {key} mentioned in the provided text is",
}


def _cell(params: dict, index: int) -> tuple[float, int]:
    depths, reps = params["depths"], int(params["haystacks"])
    if index >= len(depths) * reps:
        raise MtrainError(f"niah sample {index} is outside the grid of {len(depths)} depths x {reps} haystacks")
    return float(depths[index // reps]), index % reps


def build(ctx: BuildContext, length: int, index: int) -> Sample:
    params = ctx.params
    depth, rep = _cell(params, index)
    rng = ctx.rng(length, index)
    key = key_word(rng)
    if params["value"] not in ("number", "uuid"):
        raise MtrainError(f"niah value {params['value']!r} must be number or uuid")
    value = number_value(rng) if params["value"] == "number" else uuid_value(rng)
    needle = params["needle"].format(key=key, value=value)
    question = params["template"]
    prefix = params["answer_prefix"].format(key=key)
    ids, meta, _ = needle_prompt(
        ctx, length, params["max_new_tokens"], haystack=params["haystack"],
        make_prompt=lambda context: question.format(context=context, key=key) + prefix,
        needles=[needle], depths=[depth / 100.0], rng=rng, offset=rep * 7919,
    )
    return Sample(index, length, ids, [value], {"depth": depth, "haystack": rep, **meta})


register(Task(
    name="niah", family="niah", kind="generate", metric="answer_found", max_new_tokens=32, stop=("\n",),
    build=build, version="1", source="essay_path (Paul Graham essays, or synthetic) or offline noise",
    default_params=DEFAULTS,
    count=lambda ctx, length, requested: len(ctx.params["depths"]) * int(ctx.params["haystacks"]),
    check_data=check_essays,
))

"""InfiniteBench (OpenBMB): En.Sum, En.QA, En.MC, En.Dia, Code.Debug from its jsonl files; passkey, number_string
and kv_retrieval generated offline (or read from the files). Base-model prompts; over-long prompts cut in the middle.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Callable

from mtrain.errors import MtrainError
from mtrain.eval.registry import BuildContext, Sample, Task, register
from mtrain.eval.tasks.haystack import needle_prompt
from mtrain.eval.prompting import fit_largest
from mtrain.eval.text import read_jsonl, require_path, uuid_value

log = logging.getLogger(__name__)

# InfiniteBench's prompts for base (non-chat) models, its `yarn_mistral_templates`
TEMPLATES = {
    "passkey": "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there.\n\n{context}\n\n{input}\n\nThe pass key is",
    "number_string": "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you "
    "about the important information there.\n\n{context}\n\n{input}\n\nThe sequence of digits is",
    "kv_retrieval": "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n"
    "{input}",
    "en_sum": "Summarize the book below.\n\n{context}\n\nSummary:",
    "en_mc": "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\nA. {OPTION_A}\n"
    "B. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe letter of the correct answer is",
    "en_qa": "Read the book and answer the question. Be very concise in your answer.\n\n{context}\n\n"
    "Question: {question}\nAnswer:",
    "code_debug": "Following is a Python code where exactly one of the functions/methods has a deliberate error "
    "that makes it crash.\n\n{context}\n\nOptions:\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\n"
    "The correct option is:",
    "en_dia": "Below is a dialogue script where one random occurrence of a character name is replaced with "
    "\"$$MASK$$\", and you should try to guess who that character is.\n\n{context}\n\n"
    "The name that has been replaced with $$MASK$$ is likely",
}
FILES = {
    "passkey": "passkey.jsonl", "number_string": "number_string.jsonl", "kv_retrieval": "kv_retrieval.jsonl",
    "en_sum": "longbook_sum_eng.jsonl", "en_qa": "longbook_qa_eng.jsonl", "en_mc": "longbook_choice_eng.jsonl",
    "en_dia": "longdialogue_qa_eng.jsonl", "code_debug": "code_debug.jsonl",
}


def middle_truncate(ids: list[int], budget: int) -> list[int]:
    """InfiniteBench's truncation: keep the first and last halves of the budget, drop the middle."""
    if len(ids) <= budget:
        return ids
    head = budget // 2
    return ids[:head] + ids[len(ids) - (budget - head):]


def _path(params: dict, name: str) -> str | None:
    folder = params.get("infbench_dir")
    return os.path.join(folder, FILES[name]) if folder else None


def _records(ctx: BuildContext, name: str) -> list[dict]:
    if "records" not in ctx.memo:
        ctx.memo["records"] = read_jsonl(_path(ctx.params, name), "infbench", "infbench_dir")
    return ctx.memo["records"]


def _check_data(name: str):
    def check(params: dict) -> None:
        if name not in GENERATED or params["source"] != "generate":
            require_path(_path(params, name), "infbench", "infbench_dir")

    return check


def _options(record: dict) -> dict:
    options = record["options"]
    return {f"OPTION_{letter}": options[i] for i, letter in enumerate("ABCD")}


def _choice_references(record: dict) -> list[str]:
    """[correct option text, its letter], from an answer given as the option text (or already as [text, letter])."""
    answer = record["answer"]
    if isinstance(answer, list) and len(answer) == 2 and answer[1] in ("A", "B", "C", "D"):
        return list(answer)
    text = answer[0] if isinstance(answer, list) else answer
    if text not in record["options"]:
        raise MtrainError(f"InfiniteBench record {record.get('id')}: answer {text!r} is not among its options")
    return [text, "ABCD"[record["options"].index(text)]]


def _from_file(name: str) -> Callable[[BuildContext, int, int], Sample]:
    def build(ctx: BuildContext, length: int, index: int) -> Sample:
        record = _records(ctx, name)[index]
        fields = {"context": record["context"], "input": record.get("input", ""), "question": record.get("input", "")}
        if name in ("en_mc", "code_debug"):
            fields.update(_options(record))
            references = _choice_references(record)
        else:
            answer = record["answer"]
            references = [str(a) for a in answer] if isinstance(answer, list) else [str(answer)]
        full = ctx.encode(TEMPLATES[name].format(**fields))
        budget = length - ctx.params["max_new_tokens"]
        if budget <= 0:
            raise MtrainError(f"infbench/{name}: length {length} leaves no room for a prompt next to "
                              f"max_new_tokens {ctx.params['max_new_tokens']}")
        ids = middle_truncate(full, budget)
        meta = {"id": record.get("id", index), "prompt_tokens_before_truncation": len(full)}
        if len(ids) < len(full):
            log.info("infbench/%s sample %d: prompt of %d tokens cut in the middle to %d (length %d - %d new tokens)",
                     name, index, len(full), len(ids), length, ctx.params["max_new_tokens"])
        return Sample(index, length, ids, references, meta)

    return build


def _count_from_file(name: str):
    def count(ctx: BuildContext, length: int, requested: int) -> int:
        if name in GENERATED and ctx.params["source"] == "generate":
            return requested
        return min(requested, len(_records(ctx, name)))

    return count


# ---- offline generators (InfiniteBench's data/construct_synthetic_dataset.py) ----

def _passkey_key(rng: random.Random) -> str:
    return "".join(str(rng.randint(0, 9)) for _ in range(5))


def _number_string_key(rng: random.Random) -> str:
    """Ten digits: five random ones, each of five insertions repeating a neighbour, as InfiniteBench builds them."""
    digits = [str(rng.randint(0, 9)) for _ in range(5)]
    for k in range(5):
        pos = rng.randint(0, 5 + k - 1)
        digits.insert(pos, digits[pos])
    return "".join(digits)


RETRIEVAL = {  # name -> (key maker, needle sentence, question)
    "passkey": (_passkey_key, "The pass key is {key}. Remember it. {key} is the pass key.", "What is the pass key?"),
    "number_string": (_number_string_key, "The sequence of digits is {key}. Remember it. {key} is the sequence of "
                      "digits.", "What is the sequence of digits?"),
}


def _generated_retrieval(name: str):
    make_key, needle, question = RETRIEVAL[name]

    def build(ctx: BuildContext, length: int, index: int) -> Sample:
        if ctx.params["source"] != "generate":
            return _from_file(name)(ctx, length, index)
        rng = ctx.rng(length, index)
        key = make_key(rng)
        ids, meta, _ = needle_prompt(
            ctx, length, ctx.params["max_new_tokens"], haystack="noise", rng=rng,
            needles=[needle.format(key=key)], depths=[rng.random()],
            make_prompt=lambda context: TEMPLATES[name].format(context=context, input=question),
        )
        return Sample(index, length, ids, [key], meta)

    return build


def build_kv_retrieval(ctx: BuildContext, length: int, index: int) -> Sample:
    if ctx.params["source"] != "generate":
        return _from_file("kv_retrieval")(ctx, length, index)
    rng = ctx.rng(length, index)
    pairs: list[tuple[str, str]] = []
    depth = rng.random()
    pair_rng = random.Random(rng.random())

    def make_text(n: int) -> str:
        while len(pairs) < max(n, 1):  # prefix-stable, so n and n + 1 differ by one pair
            pairs.append((uuid_value(pair_rng), uuid_value(pair_rng)))
        shown = pairs[:max(n, 1)]
        key = shown[min(int(depth * len(shown)), len(shown) - 1)][0]
        context = "JSON data:\n{" + ", ".join(f'"{k}": "{v}"' for k, v in shown) + "}"
        query = f'Key: "{key}"\nThe value associated with the specified key is: '
        return TEMPLATES["kv_retrieval"].format(context=context, input=query)

    budget = length - ctx.params["max_new_tokens"]
    n, ids = fit_largest(lambda n: ctx.encode(make_text(n)), budget, ctx.memo.get(f"fit/kv/{length}", 8))
    if n < 1:
        raise MtrainError(f"infbench/kv_retrieval: length {length} cannot hold a single key-value pair")
    ctx.memo[f"fit/kv/{length}"] = n
    target = min(int(depth * n), n - 1)
    return Sample(index, length, ids, [pairs[target][1]], {"pairs": n, "depth": round(target / n, 4)})


GENERATED = ("passkey", "number_string", "kv_retrieval")
METRICS = {"passkey": "first_integer_match", "number_string": "first_integer_match", "kv_retrieval": "kv_word_match",
           "en_sum": "rouge_lsum", "en_qa": "token_f1", "en_mc": "choice_accuracy", "en_dia": "dialogue_name_match",
           "code_debug": "code_debug_match"}
MAX_NEW_TOKENS = {"passkey": 6, "number_string": 12, "kv_retrieval": 50, "en_sum": 1200, "en_qa": 40, "en_mc": 40,
                  "en_dia": 40, "code_debug": 5}


def _register_all() -> None:
    for name, metric in METRICS.items():
        if name in GENERATED:
            build = build_kv_retrieval if name == "kv_retrieval" else _generated_retrieval(name)
            params, source = {"source": "generate"}, "offline (source: file reads infbench_dir)"
        else:
            build, params, source = _from_file(name), {}, "infbench_dir"
        register(Task(name=f"infbench/{name}", family="infbench", kind="generate", metric=metric,
                      max_new_tokens=MAX_NEW_TOKENS[name], stop=(), build=build, default_params=params,
                      count=_count_from_file(name), source=source, check_data=_check_data(name)))


_register_all()

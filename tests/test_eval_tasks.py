"""Every offline eval task builds prompts that fit the length with the tiny tokenizers, needles included once.

Also: samples are deterministic, there is one BOS at most, and a missing external file is one clear error line.
"""

from __future__ import annotations

import logging
import os

import pytest
from test_eval_helpers import tiny_checkpoint

from mtrain.errors import MtrainError
from mtrain.eval.registry import BuildContext, get_task, resolve_tasks
from mtrain.eval.text import MissingDataError

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "eval", "fixtures")
DATA = {"essay_path": "synthetic", "pg19_path": "synthetic", "squad_path": os.path.join(FIXTURES, "squad_tiny.json"),
        "hotpotqa_path": os.path.join(FIXTURES, "hotpotqa_tiny.json"),
        "infbench_dir": os.path.join(FIXTURES, "infbench")}
# tasks generated offline (QA and InfiniteBench's book tasks read the fixtures, checked separately)
OFFLINE = [n for n in resolve_tasks(["niah", "ruler/*", "infbench/passkey", "infbench/number_string",
                                     "infbench/kv_retrieval"]) if n not in ("ruler/qa_1", "ruler/qa_2")]


@pytest.fixture(scope="module", params=["mtrain-tiny", "bos-bpe"])
def tokenizer(request):
    from transformers import AutoTokenizer

    from mtrain.tiny import load_tokenizer

    return load_tokenizer() if request.param == "mtrain-tiny" else AutoTokenizer.from_pretrained(tiny_checkpoint())


def _context(tokenizer, name: str, **extra) -> BuildContext:
    task = get_task(name)
    params = {**task.default_params, **DATA, "max_new_tokens": task.max_new_tokens, "samples": 2, **extra}
    if name == "ruler/cwe":  # the tiny suite's setting: RULER's dictionary words cost ~9 tiny tokens each
        params.update(words="tokenizer", light_below=8192)
    return BuildContext(tokenizer=tokenizer, params=params, seed=0, task_name=name)


@pytest.mark.parametrize("name", OFFLINE)
def test_offline_task_prompts_fit_the_length(tokenizer, name):
    task = get_task(name)
    for length in (2048, 4096):
        ctx = _context(tokenizer, name)
        for index in range(2):
            sample = task.build(ctx, length, index)
            used = len(sample.prompt_ids) + task.max_new_tokens
            assert used <= length, f"{name}: {used} tokens for length {length}"
            # sized, not merely short: the filler's granularity (a noise paragraph, a kv pair) is well under 10%
            assert used >= 0.9 * length, f"{name}: only {used} of {length} tokens used"
            assert sample.references and all(isinstance(r, str) for r in sample.references)
            # special tokens only where the tokenizer puts them for a whole text: one BOS at the start, if any
            bos = tokenizer.bos_token_id
            if bos is not None:
                assert sample.prompt_ids[0] == bos and sample.prompt_ids.count(bos) == 1
            text = tokenizer.decode(sample.prompt_ids, skip_special_tokens=True)
            if name == "ruler/fwe":
                assert all(f" {w} " in text for w in sample.references)
            elif name != "ruler/cwe" or length >= 8192:
                # needles (values, chain names) sit in the prompt; cwe's answers are in its list
                assert all(r in text for r in sample.references), name
        again = task.build(_context(tokenizer, name), length, 1)
        assert again.prompt_ids == sample.prompt_ids  # a sample is rebuilt identically on its own (resume)


@pytest.mark.parametrize("name", ["ruler/qa_1", "ruler/qa_2", "infbench/en_qa", "infbench/en_mc", "infbench/en_sum",
                                  "infbench/en_dia", "infbench/code_debug", "pg19"])
def test_file_task_prompts_fit_and_truncate_in_the_middle(tokenizer, name, caplog):
    caplog.set_level(logging.INFO, logger="mtrain.eval")
    task = get_task(name)
    length = 1024
    ctx = _context(tokenizer, name, **({"max_new_tokens": 64} if name == "infbench/en_sum" else {}))
    count = task.num_samples(ctx, length, 2)
    assert count >= 1
    for index in range(count):
        sample = task.build(ctx, length, index)
        budget = ctx.params["max_new_tokens"] if task.kind == "generate" else 0
        assert len(sample.prompt_ids) + budget <= length
        if name.startswith("infbench/") and sample.meta["prompt_tokens_before_truncation"] > length - budget:
            # InfiniteBench keeps the head and the tail (the question) and says so in the log
            assert len(sample.prompt_ids) == length - budget
            assert "cut in the middle" in caplog.text
            text = tokenizer.decode(sample.prompt_ids, skip_special_tokens=True)
            assert text.rstrip().endswith(("Answer:", "Summary:", "is", "is:", "likely"))


def test_qa_prompt_holds_the_gold_document(tokenizer):
    sample = get_task("ruler/qa_1").build(_context(tokenizer, "ruler/qa_1"), 1024, 0)
    text = tokenizer.decode(sample.prompt_ids, skip_special_tokens=True)
    assert "Who was the first keeper of the harbor?" in text and "named Juniper" in text
    assert sample.references == ["Juniper"]


def test_missing_external_file_is_one_clear_error(tokenizer, tmp_path):
    missing = str(tmp_path / "dev-v2.0.json")
    ctx = _context(tokenizer, "ruler/qa_1", squad_path=missing)
    with pytest.raises(MissingDataError) as err:
        get_task("ruler/qa_1").num_samples(ctx, 1024, 2)
    message = str(err.value)
    assert "\n" not in message and missing in message and "SQuAD" in message and "squad_path" in message
    ctx = _context(tokenizer, "infbench/en_mc", infbench_dir=str(tmp_path))
    with pytest.raises(MissingDataError, match="longbook_choice_eng.jsonl.*InfiniteBench"):
        get_task("infbench/en_mc").build(ctx, 1024, 0)


def test_length_too_short_for_the_fixed_text_is_an_error(tokenizer):
    with pytest.raises(MtrainError, match="without any filler"):
        get_task("ruler/niah_single_1").build(_context(tokenizer, "ruler/niah_single_1"), 160, 0)

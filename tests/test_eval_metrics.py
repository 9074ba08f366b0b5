"""Eval metrics on hand-made cases that pin the official definitions (RULER, InfiniteBench, perplexity).

Expected values are worked out by hand in the comments; scoring is checked as a pure function of records.
"""

from __future__ import annotations

import math

import pytest

from mtrain.eval import metrics
from mtrain.eval.scoring import score_records


def test_string_match_all_is_mean_fraction_of_references_found_case_insensitive():
    # 2 of 3 references found; matching ignores case; a substring is enough
    assert metrics.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert metrics.string_match_all("ANSWER: stormy-CRACKER", ["Stormy-Cracker"]) == 1.0
    assert metrics.string_match_all("12345678", ["2345"]) == 1.0
    # RULER: mean over samples of the per-sample fraction, x100: (2/3 + 1 + 0) / 3 * 100
    value = metrics.aggregate("string_match_all", ["123 456", "abc", "none"], [["123", "456", "789"], ["ABC"], ["x"]])
    assert value == pytest.approx(100 * (2 / 3 + 1 + 0) / 3)


def test_string_match_part_is_mean_of_any_reference_found():
    assert metrics.string_match_part("It is in paris.", ["Paris", "France"]) == 1.0
    assert metrics.string_match_part("Berlin", ["Paris", "France"]) == 0.0
    # one of two references is as good as both: (1 + 1 + 0) / 3 * 100
    value = metrics.aggregate("string_match_part", ["paris", "paris france", "rome"], [["Paris", "France"]] * 3)
    assert value == pytest.approx(200 / 3)


def test_ruler_postprocess_turns_control_characters_into_newlines():
    assert metrics.ruler_postprocess("  a\tb\x00c \n") == "a\nb\nc"


def test_token_f1_normalizes_and_takes_the_best_reference():
    # "The cat sat!" -> [cat, sat]; "a cat sat on the mat" -> [cat, sat, on, mat]: P = 1, R = 1/2, F1 = 2/3
    assert metrics.token_f1("The cat sat!", ["a cat sat on the mat"]) == pytest.approx(2 / 3)
    assert metrics.token_f1("The cat sat!", ["dog", "the cat sat"]) == pytest.approx(1.0)
    assert metrics.token_f1("nothing", ["cat"]) == 0.0


def test_rouge_lsum_is_summary_level_over_newline_sentences():
    # ROUGE-L over the flat text would give LCS("a b c d", "c d a b") = 2 -> F = 0.5; ROUGE-Lsum unions the
    # per-sentence LCS hits: each reference sentence is matched fully by one predicted sentence -> F = 1.
    assert metrics.rouge_lsum("c d\na b", ["a b\nc d"]) == pytest.approx(1.0)
    # one sentence: LCS("the cat sat on the mat", "the cat on the mat") = 5; P = 1, R = 5/6 -> F = 10/11
    assert metrics.rouge_lsum("the cat on the mat", ["the cat sat on the mat"]) == pytest.approx(10 / 11)


def test_infinitebench_retrieval_scorers():
    assert metrics.first_integer_match("The pass key is 71432. Done", ["71432"]) == 1.0
    assert metrics.first_integer_match("12 then 71432", ["71432"]) == 0.0  # only the first number counts
    value = "9b8efbb1-00bf-4e29-b58a-d0cd8418c785"
    assert metrics.kv_word_match(f'"{value}".', [value]) == 1.0
    assert metrics.kv_word_match(f"x{value}", [value]) == 0.0  # a whole word, not a substring


def test_infinitebench_choice_scorers():
    refs = ["inside the hollow pillow", "B"]
    assert metrics.choice_accuracy("B", refs) == 1.0
    assert metrics.choice_accuracy("C. under the bridge", refs) == 0.0  # a leading letter decides
    assert metrics.choice_accuracy(" B", refs) == 1.0  # first word that is a choice letter
    assert metrics.choice_accuracy("the answer is: inside the hollow pillow", refs) == 1.0
    assert metrics.choice_accuracy("the answer is: under the bridge", refs) == 0.0
    code_refs = ["broken", "B"]
    assert metrics.code_debug_match("B. broken", code_refs) == 1.0
    assert metrics.code_debug_match("The answer is: broken", code_refs) == 1.0
    assert metrics.code_debug_match("The answer is: scale", code_refs) == 0.0
    # En.Dia: only the first reference name, compared on upper-cased words
    assert metrics.dialogue_name_match("alpha, I think", ["ALPHA"]) == 1.0
    assert metrics.dialogue_name_match("ALPHA", ["BRAVO", "ALPHA"]) == 0.0


def _rec(task, length, index, **fields):
    return {"task": task, "length": length, "index": index, "references": fields.pop("references", []),
            "meta": fields.pop("meta", {}), **fields}


def test_perplexity_is_exp_of_total_nll_over_total_tokens():
    records = {"pg19": [_rec("pg19", 8, 0, nll=2.0, tokens=2), _rec("pg19", 8, 1, nll=12.0, tokens=6)]}
    score = score_records(records)["tasks"]["pg19"]["8"]["score"]
    # token-weighted: exp(14 / 8); the mean of per-document perplexities would be (e + e^2) / 2
    assert score == pytest.approx(math.exp(14 / 8))


def test_scoring_averages_ruler_tasks_per_length_and_ignores_rewritten_duplicates():
    records = {
        "ruler/niah_single_1": [_rec("ruler/niah_single_1", 64, 0, prediction="1234567", references=["1234567"]),
                                _rec("ruler/niah_single_1", 64, 1, prediction="no", references=["7654321"]),
                                # a duplicate of index 1 (the first record written wins)
                                _rec("ruler/niah_single_1", 64, 1, prediction="7654321", references=["7654321"])],
        "ruler/qa_1": [_rec("ruler/qa_1", 64, 0, prediction="in Paris", references=["paris", "france"])],
    }
    results = score_records(records)
    # scores 1 and 0: sample sd sqrt(0.5), over sqrt(2) -> 0.5, x100
    assert results["tasks"]["ruler/niah_single_1"]["64"] == {"metric": "string_match_all", "score": 50.0,
                                                             "stderr": 50.0, "n": 2}
    assert results["tasks"]["ruler/qa_1"]["64"]["score"] == 100.0
    assert results["tasks"]["ruler/qa_1"]["64"]["stderr"] is None  # one sample: not defined
    assert results["ruler"]["64"] == {"average": 75.0, "stderr": None, "tasks": 2, "n": 3}


def test_standard_errors_against_statistics():
    """Each cell's standard error is the sample standard deviation over sqrt(n) (Python's statistics module as the
    reference), and the RULER average's combines its tasks' as independent means: sqrt(sum se^2) / T."""
    import math
    import random
    import statistics

    rng = random.Random(0)
    answers = {"ruler/niah_single_1": [rng.random() < 0.7 for _ in range(9)],
               "ruler/niah_multikey_1": [rng.random() < 0.4 for _ in range(6)]}
    records = {name: [_rec(name, 64, i, prediction="1234567" if hit else "no", references=["1234567"])
                      for i, hit in enumerate(hits)] for name, hits in answers.items()}
    results = score_records(records)
    expected = {}
    for name, hits in answers.items():
        scores = [100.0 * hit for hit in hits]
        expected[name] = statistics.stdev(scores) / math.sqrt(len(scores))
        assert results["tasks"][name]["64"]["stderr"] == pytest.approx(expected[name], rel=1e-12)
        assert results["tasks"][name]["64"]["score"] == pytest.approx(statistics.mean(scores), rel=1e-12)
    combined = math.sqrt(sum(e * e for e in expected.values())) / 2
    assert results["ruler"]["64"]["stderr"] == pytest.approx(combined, rel=1e-12)
    assert results["ruler"]["64"]["n"] == 15


def test_niah_grid_scores_each_depth():
    records = {"niah": [_rec("niah", 32, i, prediction=p, references=["42"], meta={"depth": d})
                        for i, (p, d) in enumerate([("42", 0.0), ("41", 0.0), ("42", 50.0), ("x42", 50.0)])]}
    results = score_records(records)
    assert results["niah"]["32"] == {"0.0": 50.0, "50.0": 100.0}
    assert results["tasks"]["niah"]["32"]["score"] == 75.0


def test_paired_difference_of_two_evaluations(tmp_path):
    """Two evaluations of the same prompts: per task and length the mean of the per-sample differences and their
    standard error (statistics module as the reference), on the samples both hold; the RULER average of the
    differences combines its tasks as independent means; loglik tasks are left out."""
    import math
    import os
    import statistics

    from mtrain.eval.predictions import append_records, predictions_path
    from mtrain.eval.scoring import paired_difference

    hits = {"a": {"ruler/niah_single_1": [1, 1, 0, 1, 1, 0], "niah": [1, 1, 1, 0]},
            "b": {"ruler/niah_single_1": [1, 0, 0, 1, 0, 0, 1], "niah": [1, 0, 1, 1]}}  # b has one sample more
    for side, tasks in hits.items():
        os.makedirs(tmp_path / side / "predictions")
        for name, row in tasks.items():
            append_records(predictions_path(str(tmp_path / side), name),
                           [_rec(name, 64, i, prediction="7" if h else "no", references=["7"], meta={"depth": 0.0})
                            for i, h in enumerate(row)])
        append_records(predictions_path(str(tmp_path / side), "pg19"), [_rec("pg19", 64, 0, nll=1.0, tokens=4)])
    result = paired_difference(str(tmp_path / "a"), str(tmp_path / "b"))
    assert set(result["tasks"]) == {"ruler/niah_single_1", "niah"}
    for name in ("ruler/niah_single_1", "niah"):
        a, b = hits["a"][name], hits["b"][name][:len(hits["a"][name])]
        diffs = [100.0 * (x - y) for x, y in zip(a, b)]
        cell = result["tasks"][name]["64"]
        assert cell["n"] == len(diffs)
        assert cell["diff"] == pytest.approx(statistics.mean(diffs), rel=1e-12)
        assert cell["stderr"] == pytest.approx(statistics.stdev(diffs) / math.sqrt(len(diffs)), rel=1e-12)
    assert result["ruler"]["64"]["diff"] == pytest.approx(result["tasks"]["ruler/niah_single_1"]["64"]["diff"])
    assert result["ruler"]["64"]["tasks"] == 1 and result["niah"]["64"]["n"] == 4


def test_pooled_scores_and_differences_over_lengths(tmp_path):
    """Every length's samples of a task pooled into one cell (statistics module as the reference), the RULER tasks'
    pooled cells averaged as at one length, and the paired differences pooled the same way on the samples both
    evaluations hold."""
    import math
    import os
    import statistics

    from mtrain.eval.predictions import append_records, predictions_path
    from mtrain.eval.scoring import load_predictions, paired_difference, pooled_scores

    hits = {"a": {("niah", 64): [1, 1, 0, 1], ("niah", 128): [0, 1, 1], ("ruler/niah_single_1", 64): [1, 0, 1],
                  ("ruler/niah_single_1", 128): [1, 1], ("ruler/vt", 64): [0, 1]},
            "b": {("niah", 64): [1, 0, 0, 1], ("niah", 128): [1, 1, 1], ("ruler/niah_single_1", 64): [1, 1, 1],
                  ("ruler/niah_single_1", 128): [0, 1, 1], ("ruler/vt", 64): [0, 0]}}  # b: one sample more at 128
    for side, cells in hits.items():
        os.makedirs(tmp_path / side / "predictions")
        by_task = {}
        for (name, length), row in cells.items():
            by_task.setdefault(name, []).extend(
                _rec(name, length, i, prediction="7" if h else "no", references=["7"], meta={"depth": 0.0})
                for i, h in enumerate(row))
        for name, records in by_task.items():
            append_records(predictions_path(str(tmp_path / side), name), records)

    def cell(values):
        return statistics.mean(values), statistics.stdev(values) / math.sqrt(len(values)), len(values)

    pool = pooled_scores(load_predictions(str(tmp_path / "a")))
    niah = [100.0 * h for h in hits["a"][("niah", 64)] + hits["a"][("niah", 128)]]
    mean, err, n = cell(niah)
    assert pool["niah"]["score"] == pytest.approx(mean) and pool["niah"]["stderr"] == pytest.approx(err)
    assert pool["niah"]["n"] == n == 7
    single = cell([100.0 * h for h in hits["a"][("ruler/niah_single_1", 64)] + hits["a"][("ruler/niah_single_1", 128)]])
    vt = cell([100.0 * h for h in hits["a"][("ruler/vt", 64)]])  # vt scores a hit as 100 too (its answer found)
    assert pool["ruler"]["average"] == pytest.approx((single[0] + vt[0]) / 2)
    assert pool["ruler"]["stderr"] == pytest.approx(math.sqrt(single[1] ** 2 + vt[1] ** 2) / 2)
    assert pool["ruler"]["tasks"] == 2 and pool["ruler"]["n"] == 7

    diffs = paired_difference(str(tmp_path / "a"), str(tmp_path / "b"))["pooled"]
    paired = [100.0 * (x - y) for length in (64, 128)
              for x, y in zip(hits["a"][("niah", length)], hits["b"][("niah", length)])]
    mean, err, n = cell(paired)
    assert diffs["niah"]["diff"] == pytest.approx(mean) and diffs["niah"]["stderr"] == pytest.approx(err)
    assert diffs["niah"]["n"] == n == 7


def test_study_table(tmp_path, capsys):
    """python -m mtrain.eval.study: scores with errors and counts, the paired differences from the reference, PG-19
    relative to it, the runs' final loss; a bad --reference is a usage error."""
    import json
    import os

    from mtrain.eval import study as script
    from mtrain.eval.predictions import append_records, predictions_path

    for side, row, nll in (("dense", [1, 1, 0, 1], 4.0), ("mtraining", [1, 0, 0, 1], 4.4)):
        os.makedirs(tmp_path / side / "predictions")
        append_records(predictions_path(str(tmp_path / side), "niah"),
                       [_rec("niah", 4096, i, prediction="7" if h else "no", references=["7"], meta={"depth": 0.0})
                        for i, h in enumerate(row)])
        append_records(predictions_path(str(tmp_path / side), "pg19"), [_rec("pg19", 4096, 0, nll=nll, tokens=4)])
        (tmp_path / f"run-{side}").mkdir()
        (tmp_path / f"run-{side}" / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "loss": 2.0 + (0.1 if side == "mtraining" else 0.0)}) + "\n"
                    for s in range(1, 4)))
    out = tmp_path / "study.md"
    assert script.main(["--eval", f"dense={tmp_path / 'dense'}", "--eval", f"mtraining={tmp_path / 'mtraining'}",
                        "--reference", "dense", "--run", f"dense={tmp_path / 'run-dense'}",
                        "--run", f"mtraining={tmp_path / 'run-mtraining'}", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| mtraining | 2.1000 (last 3 steps) | +5.00% |" in text
    # dense 75 ±25 (n=4); mtraining 50 ±28.9; differences (0, -100, 0, 0): -25 ±25
    assert "| dense | 4K | 75.0 ±25.0 (n=4) |" in text
    row = next(line for line in text.splitlines() if line.startswith("| mtraining | 4K"))
    assert "50.0 ±28.9 (n=4)" in row and "-25.0 ±25.0 (n=4)" in row
    assert f"{100 * (math.exp(1.1) / math.exp(1.0) - 1):+.2f}%" in row
    with pytest.raises(SystemExit):
        script.main(["--eval", f"dense={tmp_path / 'dense'}", "--reference", "base"])
    capsys.readouterr()


def test_study_table_pools_every_length(tmp_path, capsys):
    """With more than one length, each evaluation ends with an "all" row: its prompts of every length pooled, and
    the paired difference pooled the same way."""
    import os

    from mtrain.eval import study as script
    from mtrain.eval.predictions import append_records, predictions_path

    rows = {"dense": {4096: [1, 1, 0, 1], 8192: [1, 0]}, "mtraining": {4096: [1, 0, 0, 1], 8192: [1, 1]}}
    for side, by_length in rows.items():
        os.makedirs(tmp_path / side / "predictions")
        append_records(predictions_path(str(tmp_path / side), "niah"),
                       [_rec("niah", length, i, prediction="7" if h else "no", references=["7"],
                             meta={"depth": 0.0}) for length, row in by_length.items() for i, h in enumerate(row)])
    out = tmp_path / "study.md"
    assert script.main(["--eval", f"dense={tmp_path / 'dense'}", "--eval", f"mtraining={tmp_path / 'mtraining'}",
                        "--reference", "dense", "--out", str(out)]) == 0
    capsys.readouterr()
    text = out.read_text()
    # dense: 4 of 6 found (66.7 ±21.1); mtraining: 4 of 6; paired differences (0, -100, 0, 0, 0, +100): 0 ±25.8
    assert "| dense | all | 66.7 ±21.1 (n=6) |" in text
    row = next(line for line in text.splitlines() if line.startswith("| mtraining | all"))
    assert "66.7 ±21.1 (n=6)" in row and "+0.0 ±25.8 (n=6)" in row


def test_study_pairs_by_prompt_and_refuses_different_prompts(tmp_path, capsys):
    """Two evaluations of the same prompts pair by prompt_sha256 whatever their sample order; two of different
    prompts are refused in one line naming both folders and the fix (before: "paired" by position, RULER +50.0 ±0.0,
    exit 0)."""
    import os

    from mtrain.eval.predictions import append_records, predictions_path
    from mtrain.eval.scoring import paired_difference
    from mtrain.eval.study import main

    def write(side, hits, shas):
        os.makedirs(tmp_path / side / "predictions", exist_ok=True)
        append_records(predictions_path(str(tmp_path / side), "niah"),
                       [_rec("niah", 64, i, prediction="7" if h else "no", references=["7"], meta={"depth": 0.0},
                             prompt_sha256=sha) for i, (h, sha) in enumerate(zip(hits, shas))])

    write("a", [1, 1, 0], ["p0", "p1", "p2"])
    write("b", [0, 1, 1], ["p2", "p1", "p0"])  # the same prompts in another order: p0 1-1, p1 1-1, p2 0-0
    cell = paired_difference(str(tmp_path / "a"), str(tmp_path / "b"))["tasks"]["niah"]["64"]
    assert cell["diff"] == 0.0 and cell["n"] == 3
    write("c", [0, 0, 0], ["q0", "q1", "q2"])
    rc = main(["--eval", f"a={tmp_path / 'a'}", "--eval", f"c={tmp_path / 'c'}", "--reference", "c"])
    err = capsys.readouterr().err
    assert rc == 2 and "scored different prompts" in err and "same suite, seed and tokenizer" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_study_final_loss_skips_a_torn_last_line(tmp_path):
    """metrics.jsonl of a run killed mid-write: the study reads its complete lines, as the trainer and compare do
    (before: a JSONDecodeError traceback)."""
    from mtrain.eval.study import final_loss

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}\n{"step": 3, "lo')
    assert final_loss(str(tmp_path), 10) == (1.5, 2)

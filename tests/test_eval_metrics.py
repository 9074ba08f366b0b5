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
    assert results["tasks"]["ruler/niah_single_1"]["64"] == {"metric": "string_match_all", "score": 50.0, "n": 2}
    assert results["tasks"]["ruler/qa_1"]["64"]["score"] == 100.0
    assert results["ruler"]["64"] == {"average": 75.0, "tasks": 2}


def test_niah_grid_scores_each_depth():
    records = {"niah": [_rec("niah", 32, i, prediction=p, references=["42"], meta={"depth": d})
                        for i, (p, d) in enumerate([("42", 0.0), ("41", 0.0), ("42", 50.0), ("x42", 50.0)])]}
    results = score_records(records)
    assert results["niah"]["32"] == {"0.0": 50.0, "50.0": 100.0}
    assert results["tasks"]["niah"]["32"]["score"] == 75.0

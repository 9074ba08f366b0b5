"""Per-sample scorers of the eval stage, each pinned to the definition of the benchmark that owns it.

RULER: string_match_all / string_match_part; InfiniteBench: token F1, ROUGE-Lsum, choice and exact scorers.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Callable, Sequence

_CONTROL_CHARS = re.compile(r"[\x00-\x1f]")


def ruler_postprocess(prediction: str) -> str:
    """RULER's cleanup of a raw generation: control characters become newlines, then strip."""
    return _CONTROL_CHARS.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER: fraction of the references found in the prediction (case-insensitive substring), in [0, 1]."""
    pred = prediction.lower()
    return sum(1.0 for ref in references if ref.lower() in pred) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """RULER: 1 if any reference is found in the prediction (case-insensitive substring), else 0."""
    pred = prediction.lower()
    return float(any(ref.lower() in pred for ref in references))


def answer_found(prediction: str, references: Sequence[str]) -> float:
    """Needle-in-a-haystack: 1 if every reference string occurs in the prediction (case-insensitive)."""
    return float(string_match_all(prediction, references) == 1.0)


# ---- InfiniteBench (definitions of its compute_scores.py) ----

def normalize_answer(text: str) -> str:
    """SQuAD-style normalization: lower case, drop punctuation and the articles a/an/the, squeeze spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, references: Sequence[str]) -> float:
    """Max over references of the bag-of-tokens F1 between normalized prediction and reference."""
    best = 0.0
    pred_tokens = normalize_answer(prediction).split()
    for ref in references:
        ref_tokens = normalize_answer(ref).split()
        common = Counter(pred_tokens) & Counter(ref_tokens)
        same = sum(common.values())
        if same == 0:
            continue
        precision = same / len(pred_tokens)
        recall = same / len(ref_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def rouge_lsum(prediction: str, references: Sequence[str]) -> float:
    """ROUGE-Lsum F-measure (rouge-score, no stemming), max over references; summary sentences split on newlines."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=False)
    return max(scorer.score(ref, prediction)["rougeLsum"].fmeasure for ref in references)


def first_integer_match(prediction: str, references: Sequence[str]) -> float:
    """InfiniteBench passkey / number_string: the first run of digits in the prediction equals the label."""
    match = re.search(r"\d+", prediction)
    return float(match is not None and match.group(0) == str(references[0]))


def _split_words(prediction: str) -> list[str]:
    for ch in ("\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"):
        prediction = prediction.replace(ch, " ")
    return prediction.split()


def kv_word_match(prediction: str, references: Sequence[str]) -> float:
    """InfiniteBench kv_retrieval: the value appears as a whole word once punctuation becomes spaces."""
    return float(references[0] in _split_words(prediction))


def dialogue_name_match(prediction: str, references: Sequence[str]) -> float:
    """InfiniteBench En.Dia: the first reference name appears among the prediction's upper-cased words."""
    return float(references[0] in [w.upper() for w in _split_words(prediction)])


def _squeeze(text: str, remove: Sequence[str]) -> str:
    for ch in remove:
        text = text.replace(ch, " ")
    while "  " in text:
        text = text.replace("  ", " ")
    return text


def _after_prefix(prediction: str, prefixes: Sequence[str], accepted: Sequence[str]) -> bool | None:
    """After the first prefix found (in `prefixes` order), does the text start with an accepted string?

    None when no prefix occurs. The character after the prefix (a space) is skipped, as InfiniteBench does.
    """
    for prefix in prefixes:
        idx = prediction.find(prefix)
        if idx == -1:
            continue
        rest = prediction[idx + len(prefix) + 1:]
        return bool(rest) and any(rest.startswith(s) for s in accepted)
    return None


def choice_accuracy(prediction: str, references: Sequence[str]) -> float:
    """InfiniteBench En.MC; references = [correct option text, its letter].

    A first character A-D decides; else the text after an "answer is:"-like prefix must start with the option
    or its letter; else the first word that is (a substring of) "ABCD" must be the letter.
    """
    if not prediction:
        return 0.0
    if prediction[0] in "ABCD":
        return float(prediction[0] in references)
    pred = _squeeze(prediction, ("\n", '"', "'", ".", ",", "?", "!", "{", "}"))
    found = _after_prefix(pred, ("answer is:", "answer:", "answer is", "option is"), references)
    if found is not None:
        return float(found)
    for word in pred.split():
        if word in "ABCD":
            return float(word in references)
    return 0.0


def code_debug_match(prediction: str, references: Sequence[str]) -> float:
    """InfiniteBench Code.Debug; references = [function name, option letter]: "B." / "B:" or after a prefix."""
    fn_name, letter = references[0], references[1]
    if prediction[:2] in (f"{letter}.", f"{letter}:"):
        return 1.0
    pred = _squeeze(prediction.strip(), ("\n", "`", "'", '"', "-", "*", "Option", "option"))
    return float(bool(_after_prefix(pred, ("answer is:", "is:", "answer:"), (letter, fn_name))))


# metric name -> (per-sample scorer, scale of the reported number)
METRICS: dict[str, tuple[Callable[[str, Sequence[str]], float], float]] = {
    "string_match_all": (string_match_all, 100.0),
    "string_match_part": (string_match_part, 100.0),
    "answer_found": (answer_found, 100.0),
    "token_f1": (token_f1, 100.0),
    "rouge_lsum": (rouge_lsum, 100.0),
    "first_integer_match": (first_integer_match, 100.0),
    "kv_word_match": (kv_word_match, 100.0),
    "dialogue_name_match": (dialogue_name_match, 100.0),
    "choice_accuracy": (choice_accuracy, 100.0),
    "code_debug_match": (code_debug_match, 100.0),
}


def aggregate(metric: str, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Mean of the per-sample score over samples, times the metric's scale (RULER and InfiniteBench report ×100)."""
    scorer, scale = METRICS[metric]
    if not predictions:
        raise ValueError(f"no predictions to score with {metric}")
    return scale * sum(scorer(p, r) for p, r in zip(predictions, references, strict=True)) / len(predictions)

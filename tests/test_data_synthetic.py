"""The synthetic corpus' retrieval documents: the eval's own needle prompts, answered (what stage 1/2 train on)."""

from __future__ import annotations

import json
import random
import re

import pytest

from mtrain.data import synthetic as S


def test_retrieval_templates_are_the_evals():
    from mtrain.eval.tasks import infbench, niah, ruler
    from mtrain.eval.text import NOISE

    assert S.NIAH_NEEDLE == niah.DEFAULTS["needle"]
    assert S.NIAH_TEMPLATE == niah.DEFAULTS["template"]
    assert S.NIAH_ANSWER_PREFIX == niah.DEFAULTS["answer_prefix"]
    # RULER's single-answer wording, as ruler._niah_builder derives it for one key and one value
    singular = ruler.NIAH_TEMPLATE.replace("Some", "A").replace("are all", "is").replace("are", "is")
    assert S.RULER_TEMPLATE == singular.replace("{type_needle_v}", "number")
    assert S.RULER_NEEDLE == ruler.NEEDLE.replace("{type_needle_v}", "numbers")
    _, needle, question = infbench.RETRIEVAL["passkey"]
    assert (S.PASSKEY_PROMPT, S.PASSKEY_NEEDLE, S.PASSKEY_INPUT) == (infbench.TEMPLATES["passkey"], needle, question)
    assert S.NOISE == NOISE


def _docs(fmt: str, n: int = 30, **spec) -> list[str]:
    spec = S.CorpusSpec(num_docs=n, min_sentences=2, max_sentences=30, retrieval=1.0, formats=((fmt, 1.0),), **spec)
    return S.generate(spec)


def test_niah_documents_answer_the_evals_question_from_their_needle():
    intro = S.NIAH_TEMPLATE.split("{context}")[0]
    qa = re.compile(r"What is the special magic number for (\S+) mentioned in the provided text\? "
                    r"The special magic number for \1 mentioned in the provided text is (\d{7})\.")
    for doc in _docs("niah"):
        assert doc.startswith(intro)
        context, *questions = doc[len(intro):].split("\n")
        answered = [qa.fullmatch(q) for q in questions]
        assert questions and all(answered), questions
        for match in answered:  # every answer is the value its needle states in the context
            assert S.NIAH_NEEDLE.format(key=match[1], value=match[2]) in context
        assert len(questions) == context.count("The special magic number for")


def test_eval_prompt_is_a_prefix_of_a_training_document():
    """The eval's NIAH prompt (built by the eval itself) continues, in training text, with the answer."""
    from mtrain.eval.registry import BuildContext, get_task
    from mtrain.tiny import load_tokenizer

    tok = load_tokenizer()
    task = get_task("niah")
    params = {**task.default_params, "essay_path": "synthetic", "haystacks": 1, "max_new_tokens": 12}
    ctx = BuildContext(tokenizer=tok, seed=0, task_name="niah", params=params)
    sample = task.build(ctx, 512, 2)
    prompt = tok.decode(sample.prompt_ids)
    key = re.search(r"magic number for (\S+) is: ", prompt)[1]
    value = sample.references[0]
    assert S.NIAH_NEEDLE.format(key=key, value=value) in prompt
    assert prompt.endswith(S.NIAH_ANSWER_PREFIX.format(key=key))
    # the same prompt, answered as training documents are, parses as one
    intro = S.NIAH_TEMPLATE.split("{context}")[0]
    assert prompt.startswith(intro) and (prompt + f" {value}.").count("\n") == 2


@pytest.mark.parametrize("fmt", ["ruler", "passkey", "repeat"])
def test_other_formats(fmt):
    for doc in _docs(fmt):
        if fmt == "ruler":
            assert doc.startswith("A special magic number is hidden")
            key, value = re.search(r"The special magic number for (\S+) mentioned in the provided text is (\d{7})\.",
                                   doc).groups()
            assert S.RULER_NEEDLE.format(key=key, value=value) in doc
        elif fmt == "passkey":
            value = re.fullmatch(r".*\n\nThe pass key is (\d{5})\.", doc, re.S)[1]
            assert S.PASSKEY_NEEDLE.format(key=value) in doc and S.NOISE in doc
        else:
            first, second = doc.split(S.REPEAT_JOIN)
            assert first == second and "The special magic number for" in first


def test_generation_is_deterministic_and_mixes_formats():
    spec = S.CorpusSpec(num_docs=60, min_sentences=1, max_sentences=20, retrieval=1.0)
    docs = S.generate(spec)
    assert docs == S.generate(spec)
    assert any(S.REPEAT_JOIN in d for d in docs) and any(d.startswith("Some special magic") for d in docs)
    # retrieval=0 keeps the facts documents (the tokenizer is built from those)
    facts = S.generate(S.CorpusSpec(num_docs=5, max_sentences=20))
    assert facts == [S.make_document(rng, S.CorpusSpec(num_docs=5, max_sentences=20))
                     for rng in [random.Random(0)] for _ in range(5)]


def test_cli_rejects_bad_formats(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        S.main(["--out", str(tmp_path / "x.jsonl"), "--retrieval", "1", "--formats", "niah=1,haystack=2"])
    assert exit_.value.code == 2 and "--formats 'haystack=2'" in capsys.readouterr().err
    assert S.main(["--out", str(tmp_path / "x.jsonl"), "--docs", "3", "--retrieval", "1",
                   "--formats", "passkey=1"]) == 0


def test_value_digits_lengthen_the_needle_values():
    """--value-digits LO:HI: niah values (fitted or not) have LO..HI digits, the answer copies the whole value;
    the default stays the eval's 7 digits."""
    qa = re.compile(r"The special magic number for (\S+) mentioned in the provided text is (\d+)\.")
    lengths = set()
    for doc in _docs("niah", n=20, value_digits=(9, 12)) + _docs("niah", n=4, fit_tokens=(512,), value_digits=(9, 12)):
        for key, value in qa.findall(doc):
            assert 9 <= len(value) <= 12 and S.NIAH_NEEDLE.format(key=key, value=value) in doc
            lengths.add(len(value))
    assert len(lengths) > 1
    assert {len(v) for doc in _docs("niah", n=10) for _, v in qa.findall(doc)} == {7}
    with pytest.raises(SystemExit):
        S.main(["--out", "x.jsonl", "--value-digits", "9:7"])


def test_copy_drills_repeat_one_run_to_the_token_count():
    """Copy drills: a run of 8..40 tokens (pool words, digits or prose) repeated to exactly `tokens` tokens."""
    pool, digits, tok = S.copy_pool()
    spec = S.CopySpec(num_docs=40, tokens=127, min_period=8, max_period=40, digits=0.3, prose=0.3, seed=1)
    kinds = set()
    for doc in S.generate_copies(spec):
        ids = tok.encode(doc)
        assert len(ids) == 127  # the text encodes back to the drill's own tokens
        period = next(p for p in range(1, 41) if all(ids[i] == ids[i - p] for i in range(p, 127)))
        assert period <= 40
        kinds.add("digits" if set(ids) <= set(digits) else "pool" if set(ids) <= set(pool) else "prose")
    assert kinds == {"digits", "prose", "pool"}  # prose: filler tokens outside the pool (",", ".", word pieces)


def test_needle_drills_repeat_prose_with_the_evals_needles():
    """--copy-needles: the run is filler prose with the eval's needle sentences (7-digit values) planted in it,
    repeated at the drill's period, so each value is copied across the whole period."""
    _, _, tok = S.copy_pool()
    spec = S.CopySpec(num_docs=6, tokens=2047, min_period=600, max_period=900, needles=1.0, seed=3)
    for doc in S.generate_copies(spec):
        ids = tok.encode(doc)
        assert len(ids) == 2047
        period = next(p for p in range(600, 901) if all(ids[i] == ids[i - p] for i in range(p, 2047)))
        run = tok.decode(ids[:period])
        values = re.findall(r"The special magic number for [a-z]+-[a-z]+ is: (\d{7})\.", run)
        assert len(values) >= 2  # ~one sentence in NEEDLE_EVERY, ~27 tokens each
        assert all(doc.count(v) >= 2 for v in values)  # every value comes again one period later
    # the shares add up: digits, prose and needle runs all in one corpus
    mixed = S.CopySpec(num_docs=30, tokens=255, min_period=100, max_period=200, digits=0.3, prose=0.3,
                       needles=0.3, seed=1)
    assert any("magic number" in doc for doc in S.generate_copies(mixed))
    with pytest.raises(SystemExit):
        S.main(["--out", "x.jsonl", "--copy-period", "8:16", "--copy-digits", "0.5", "--copy-needles", "0.6"])


def test_far_drills_copy_the_run_once_across_filler():
    """--copy-far: the run, filler prose, the run again: exactly `tokens` tokens, one copy `tokens - period` back."""
    _, digits, tok = S.copy_pool()
    spec = S.CopySpec(num_docs=12, tokens=1023, min_period=20, max_period=100, digits=0.5, far=True, seed=2)
    kinds = set()
    for doc in S.generate_copies(spec):
        ids = tok.encode(doc)
        assert len(ids) == 1023
        period = next(p for p in range(20, 101) if ids[:p] == ids[-p:])  # the run opens and closes the drill
        gap = tok.decode(ids[period:-period])
        assert re.fullmatch(r"( [A-Za-z ,]+\.)+( (the|a|and))*", gap), gap[-80:]
        kinds.add("digits" if set(ids[:period]) <= set(digits) else "other")
    assert kinds == {"digits", "other"}
    with pytest.raises(SystemExit):
        S.main(["--out", "x.jsonl", "--copy-period", "8:600", "--copy-tokens", "1023", "--copy-far"])


def test_spread_drills_copy_across_any_distance_and_end_the_drill():
    """--copy-spread: filler, the run, filler, the run: exactly `tokens` tokens, the second copy last, the
    distance between the copies drawn over the whole range (not always `tokens - period`)."""
    _, _, tok = S.copy_pool()
    spec = S.CopySpec(num_docs=16, tokens=1023, min_period=20, max_period=60, digits=0.5, far=True, spread=True,
                      seed=3)
    starts = []
    for doc in S.generate_copies(spec):
        ids = tok.encode(doc)
        assert len(ids) == 1023
        # the longest closing stretch (up to the longest period) that also occurs earlier: the run, copied
        start, period = next((i, p) for p in range(60, 19, -1) for i in range(1023 - 2 * p + 1)
                             if ids[i:i + p] == ids[-p:])
        prefix = tok.decode(ids[:start])
        assert re.fullmatch(r"( [A-Za-z ,]+\.)*( (the|a|and))*", prefix), prefix[-80:]
        starts.append(start)
    assert min(starts) < 200 and max(starts) > 600  # near and far copies both
    with pytest.raises(SystemExit):
        S.main(["--out", "x.jsonl", "--copy-period", "8:16", "--copy-tokens", "1023", "--copy-spread"])


def test_edge_depths_put_fitted_needles_at_an_end_of_the_haystack():
    """--edge-depths 1: every fitted needle opens the haystack or is its last whole sentence (the words the fit
    adds may follow it), as at the eval's depths 0 and 100."""
    intro = S.NIAH_TEMPLATE.split("{context}")[0]
    ends = set()
    for doc in _docs("niah", n=12, fit_tokens=(512,), edge_depths=1.0):
        context = doc[len(intro):doc.index("\nWhat is")]
        needle = re.search(r"The special magic number for \S+ is: \d{7}\.", context).group(0)
        after = context.split(needle)[1]
        assert context.startswith(needle) or "." not in after, context[:60] + " ... " + context[-60:]
        ends.add(context.startswith(needle))
    assert ends == {True, False}
    with pytest.raises(SystemExit):
        S.main(["--out", "x.jsonl", "--edge-depths", "1.5"])


def test_repeat_runs_and_values_repeat_digits_and_fragments(tmp_path):
    """--copy-repeats: drills whose run is digits full of doubled digits and fragments said again (copied whole one
    period later); --value-repeats: needle values built the same way (no leading zero, the answer copies the
    value). Both default to 0, which leaves the corpus as it was (no extra draws)."""
    _, digits, tok = S.copy_pool()
    spec = S.CopySpec(num_docs=12, tokens=255, min_period=40, max_period=100, repeats=1.0, seed=4)
    doubles = fragments = 0
    for doc in S.generate_copies(spec):
        ids = tok.encode(doc)
        assert len(ids) == 255 and set(ids) <= set(digits)
        period = next(p for p in range(40, 101) if all(ids[i] == ids[i - p] for i in range(p, 255)))
        run = tok.decode(ids[:period])
        doubles += sum(a == b for a, b in zip(run, run[1:]))
        fragments += sum(run.count(run[i:i + 3]) > 1 for i in range(len(run) - 2))
    assert doubles > 12 * 40 * 0.1 + 20 and fragments > 12 * 40 * 0.3  # random digits: ~10% doubles, few 3-grams
    mixed = S.CopySpec(num_docs=30, tokens=127, min_period=8, max_period=40, digits=0.3, prose=0.3, seed=1)
    assert S.generate_copies(mixed) == S.generate_copies(S.CopySpec(**{**mixed.__dict__, "repeats": 0.0}))
    qa = re.compile(r"The special magic number for (\S+) mentioned in the provided text is (\d+)\.")
    values = [(k, v, doc) for doc in _docs("niah", n=4, fit_tokens=(512,), value_digits=(12, 20), value_repeats=1.0)
              for k, v in qa.findall(doc)]
    assert len(values) == 4
    for key, value, doc in values:
        assert 12 <= len(value) <= 20 and value[0] != "0" and S.NIAH_NEEDLE.format(key=key, value=value) in doc
    assert sum(a == b for _, v, _ in values for a, b in zip(v, v[1:])) >= 4
    assert _docs("niah", n=6, value_digits=(7, 20)) == _docs("niah", n=6, value_digits=(7, 20), value_repeats=0.0)
    with pytest.raises(SystemExit):
        S.main(["--out", str(tmp_path / "x.jsonl"), "--value-repeats", "2"])
    with pytest.raises(SystemExit):
        S.main(["--out", str(tmp_path / "x.jsonl"), "--copy-period", "8:16", "--copy-digits", "0.5",
                "--copy-repeats", "0.6"])


def test_copy_drills_cli(tmp_path):
    out = tmp_path / "copy.jsonl"
    assert S.main(["--out", str(out), "--copy-period", "16:16", "--copy-tokens", "127", "--docs", "3"]) == 0
    docs = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert len(docs) == 3 and len(set(docs)) == 3
    with pytest.raises(SystemExit):
        S.main(["--out", str(out), "--copy-period", "200:100"])


def test_fitted_documents_fill_their_token_count_and_pack_whole(tmp_path):
    """--fit-tokens: each niah/ruler document plus its EOS is exactly one of the counts, answers its own needle,
    and `mtrain pack --order length` keeps every one whole in one sample (no question cut from its needle)."""
    import numpy as np

    from mtrain.data.mds import MDSFolder
    from mtrain.data.packer import pack
    from mtrain.tiny import TOKENIZER_DIR

    _, _, tok = S.copy_pool()
    docs = _docs("niah", n=12, fit_tokens=(512, 256)) + _docs("ruler", n=4, fit_tokens=(256,))
    assert sorted({len(tok.encode(d)) + 1 for d in docs}) == [256, 512]
    for doc in docs:
        value = re.search(r"is:? (\d{7})\.", doc).group(1)
        assert doc.endswith(f" {value}.") and doc.count(value) == 2  # the needle and the answer
    S.write_jsonl(tmp_path / "fit.jsonl", docs)
    drills = S.generate_copies(S.CopySpec(num_docs=8, tokens=127, seed=1))
    S.write_jsonl(tmp_path / "drills.jsonl", drills)
    pack([f"{tmp_path / 'fit.jsonl'}:jsonl", f"{tmp_path / 'drills.jsonl'}:jsonl"], TOKENIZER_DIR, 512,
         tmp_path / "packed", order="length", progress=False, workers=1)
    folder = MDSFolder(str(tmp_path / "packed"))
    whole = 0
    for k in range(len(folder)):
        sample = folder[k]
        for a, b in sample["indices"].reshape(-1, 2):
            text = tok.decode(np.asarray(sample["input_ids"][a:b]).tolist())
            if "magic number" in text:
                whole += 1
                assert text.startswith(("Some special", "A special")) and re.search(r"is \d{7}\.", text)
    assert whole == len(docs)
    with pytest.raises(SystemExit):
        S.main(["--out", str(tmp_path / "x.jsonl"), "--fit-tokens", "8192,x"])

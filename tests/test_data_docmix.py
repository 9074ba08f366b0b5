"""mtrain.data.docmix: sequences of real long documents in fixed mixes, written as an MDS folder the trainer reads."""

from __future__ import annotations

import os

import pytest

from mtrain.data import docmix
from mtrain.data.reader import TrainingReader
from mtrain.errors import MtrainError
from mtrain.tiny import TOKENIZER_DIR


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def _texts(n=3, words=4000):
    # distinct texts: each word names its text and its place, so every window's tokens differ
    return [(f"text{t}", " ".join(f"w{t}x{i}" for i in range(words))) for t in range(n)]


@pytest.mark.parametrize("mix, seq", [("long", 1000), ("long", 131072), ("short", 4096), ("short", 4099)])
def test_mix_lengths_follow_the_shares_and_fill_the_sequence(mix, seq):
    lengths = docmix.mix_lengths(seq, mix)
    assert sum(lengths) == seq
    if mix == "long":
        assert lengths[:3] == [int(seq * s) for s in docmix.LONG_SHARES[:3]]
    else:
        assert len(lengths) == docmix.SHORT_DOCS and lengths[0] == seq // docmix.SHORT_DOCS


def test_bad_mixes_are_refused_in_one_line():
    with pytest.raises(MtrainError, match="mix must be one of long, short"):
        docmix.mix_lengths(1024, "medium")
    with pytest.raises(MtrainError, match="under 2 tokens"):
        docmix.mix_lengths(16, "short")


def test_written_mix_reads_back_with_its_documents(tmp_path, tokenizer):
    """Each sample holds the mix's documents (the reader's doc_spans are their lengths); a document is the start
    of its text's next unused window (the first one tokenized alone gives the same ids); the samples differ."""
    texts = _texts()
    out = str(tmp_path / "mix")
    summary = docmix.write_mix(out, tokenizer, 400, 3, "long", texts=texts)
    assert summary["document_lengths"] == docmix.mix_lengths(400, "long") and summary["repeats"] == 0
    assert summary["documents"][0] == ["text0", "text1", "text2", "text0"]
    reader = TrainingReader(out, shuffle=False, document_masking=True)
    samples = list(reader)
    assert len(samples) == 3
    ends = [int(e) for e in samples[0]["doc_spans"][:, 1]]
    assert ends == [sum(summary["document_lengths"][: i + 1]) for i in range(4)]
    first = tokenizer(texts[0][1][: 164 * docmix.CHARS_PER_TOKEN], add_special_tokens=False)["input_ids"][:164]
    assert samples[0]["input_ids"][:164].tolist() == first
    assert not samples[0]["input_ids"].equal(samples[1]["input_ids"])
    # the fourth document continues text0 after the first: no window of a text repeats
    fourth = samples[0]["input_ids"][ends[2]:ends[3]].tolist()
    assert tokenizer.decode(fourth[:8]).strip() not in tokenizer.decode(first)


def test_texts_used_up_start_over_and_are_counted(tokenizer):
    packer = docmix.MixPacker(tokenizer, 1000, "long", _texts(n=1, words=100))  # ~700 tokens: the second document wraps
    packer.sample()
    assert packer.repeats >= 1


def test_a_finished_mix_is_kept_and_another_request_refused(tmp_path, tokenizer):
    out = str(tmp_path / "mix")
    first = docmix.write_mix(out, tokenizer, 256, 2, "short", texts=_texts())
    stamp = os.stat(os.path.join(out, "mix.json")).st_mtime_ns
    assert docmix.write_mix(out, tokenizer, 256, 2, "short", texts=_texts()) == first
    assert os.stat(os.path.join(out, "mix.json")).st_mtime_ns == stamp
    with pytest.raises(MtrainError, match="exists and is not this request's mix"):
        docmix.write_mix(out, tokenizer, 512, 2, "short", texts=_texts())


def test_a_failed_write_leaves_nothing(tmp_path, tokenizer):
    out = tmp_path / "mix"
    with pytest.raises(MtrainError, match="no text here holds"):
        docmix.write_mix(str(out), tokenizer, 4000, 2, "long", texts=[("tiny", "a few words")])
    assert not out.exists() and not any(p.name.startswith("mix.tmp") for p in tmp_path.iterdir())


@pytest.mark.parametrize("args, words", [
    (["--seq-len", "0"], "--seq-len must be a positive integer"),
    (["--samples", "0"], "--samples must be a positive integer"),
    (["--tokenizer", "no/such/folder"], "no such folder"),
    (["--seq-len", "20", "--mix", "short"], "under 2 tokens"),
])
def test_mtrain_docmix_refuses_bad_requests_in_one_line(tmp_path, capsys, args, words):
    from mtrain.cli import main

    base = {"--tokenizer": str(TOKENIZER_DIR), "--seq-len": "400", "--samples": "2", "--out": str(tmp_path / "out")}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    assert main(["docmix", *[x for kv in base.items() for x in kv]]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_mtrain_docmix_writes_a_mix_the_trainer_reads(tmp_path, capsys):
    from mtrain.cli import main

    out = tmp_path / "mix"
    assert main(["docmix", "--tokenizer", str(TOKENIZER_DIR), "--seq-len", "400", "--samples", "2", "--mix", "short",
                 "--out", str(out), "--no-progress"]) == 0
    assert "2 sequences of 400 tokens" in capsys.readouterr().out
    samples = list(TrainingReader(str(out), shuffle=False, document_masking=True))
    assert len(samples) == 2
    assert [int(e) for e in samples[1]["doc_spans"][:, 1]] == [25 * (i + 1) for i in range(15)] + [400]


def test_python_m_docmix_reads_its_arguments_from_the_command_line(tmp_path, capsys, monkeypatch):
    """`python -m mtrain.data.docmix ...` (what scripts/gpu_train_docs.sh runs): main() without argv reads sys.argv,
    refusing a bad request in one line as `mtrain docmix` does."""
    from mtrain.data import docmix

    monkeypatch.setattr("sys.argv", ["docmix", "--tokenizer", str(TOKENIZER_DIR), "--seq-len", "0", "--samples", "2",
                                     "--out", str(tmp_path / "out")])
    assert docmix.main() == 2
    assert "--seq-len must be a positive integer" in capsys.readouterr().err

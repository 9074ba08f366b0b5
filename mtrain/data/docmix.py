"""Packed sequences of real long documents in fixed mixes, for training and benchmarks on the same kind of pack.

A mix fixes each sequence's document lengths as shares of its length: `long` four documents of 41 / 31 / 19 / 9%
(at 128K: 53.7K, 40.6K, 24.9K and 11.8K tokens, lengths like a long-context stage's books and code repositories),
`short` sixteen equal pieces. The documents are windows of the long real texts of this Python installation
(`mtrain.data.longdocs`: the reference documentation, the standard library's docstrings, the license texts, and
the source of the standard library's larger packages, plus any installed packages named), taken in turn so that
no window repeats until every text is used up.

`mtrain bench real --documents MIX` packs one such sequence (sample 0); `write_mix` writes many as an MDS folder
the trainer reads (`data.path`, with `data.document_masking: true`):

  mtrain docmix --tokenizer models/smollm2-135m --seq-len 131072 --samples 22 --mix long \\
      --out data/packed/docs-long-128k

(`python -m mtrain.data.docmix` takes the same arguments.)
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from mtrain.errors import MtrainError

MIXES = ("long", "short")
LONG_SHARES = (0.41, 0.31, 0.19, 0.09)
"""The long mix's document lengths as shares of the sequence (the last one takes what is left)."""
SHORT_DOCS = 16
CHARS_PER_TOKEN = 8
"""Characters read per wanted token: more than any of these texts needs under a BPE tokenizer (about 3-4)."""
COLUMNS = {"input_ids": "ndarray:uint32", "indices": "ndarray:uint32", "domain": "str", "length": "int"}
"""The packer's sample schema (`mtrain.data.packer.COLUMNS`), which the training reader reads."""


def mix_lengths(seq_len: int, mix: str) -> list[int]:
    """The document lengths of one sequence of `seq_len` tokens in mix `mix` (they sum to seq_len)."""
    if mix not in MIXES:
        raise MtrainError(f"mix must be one of {', '.join(MIXES)}; got {mix!r}")
    if mix == "long":
        lengths = [int(seq_len * share) for share in LONG_SHARES[:-1]]
    else:
        lengths = [seq_len // SHORT_DOCS] * (SHORT_DOCS - 1)
    lengths.append(seq_len - sum(lengths))
    if min(lengths) < 2:
        raise MtrainError(f"a {mix} mix of {seq_len} tokens has documents of under 2 tokens; use a longer seq_len")
    return lengths


def document_texts(packages=()) -> list[tuple[str, str]]:
    """(name, text) of the long real texts, in a fixed order that alternates books and code (`mtrain.data.longdocs`;
    `packages`: installed packages added as code repositories after the standard library's)."""
    from mtrain.data.longdocs import books, code_repos

    book, code = list(books(min_doc_chars=200_000)), code_repos(packages, min_doc_chars=400_000)
    out = []
    for i, (name, text) in enumerate(book):
        out.append((name, text))
        if i == 0:
            out.append(next(code))
    out.extend(code)
    return out


class MixPacker:
    """Sequences of mix `mix` from `texts` ((name, text) pairs): each document is the next unused window of the
    next text in turn that still holds enough characters; when none does, every text starts over (`repeats`
    counts the documents taken from text already used)."""

    def __init__(self, tokenizer, seq_len: int, mix: str, texts):
        self.tokenizer, self.lengths, self.texts = tokenizer, mix_lengths(seq_len, mix), list(texts)
        if not self.texts:
            raise MtrainError("no long texts to pack (this Python installation has none of 200K characters)")
        self.cursor = [0] * len(self.texts)
        self.turn, self.repeats = 0, 0

    def _window(self, t: int, n: int) -> list[int] | None:
        """n tokens of text t from its cursor (moved past them), or None when the text holds fewer."""
        text = self.texts[t][1][self.cursor[t]: self.cursor[t] + n * CHARS_PER_TOKEN]
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        if len(ids) < n:
            return None
        self.cursor[t] += int(enc["offset_mapping"][n - 1][1])
        return ids[:n]

    def document(self, n: int) -> tuple[list[int], str]:
        """The next document of n tokens and its text's name."""
        for wrapped in (False, True):
            if wrapped:  # every text used up: start each over
                self.cursor = [0] * len(self.texts)
            for step in range(len(self.texts)):
                t = (self.turn + step) % len(self.texts)
                ids = self._window(t, n)
                if ids is not None:
                    self.turn = t + 1
                    self.repeats += wrapped
                    return ids, self.texts[t][0]
        raise MtrainError(f"no text here holds {n} tokens; use a shorter seq_len or add --packages")

    def sample(self) -> tuple[list[int], list[int], list[str]]:
        """(token ids, document lengths, text names) of the next sequence."""
        ids, names = [], []
        for n in self.lengths:
            doc, name = self.document(n)
            ids.extend(doc)
            names.append(name)
        return ids, list(self.lengths), names


def packed_mix(tokenizer, seq_len: int, mix: str, texts=None) -> tuple[list[int], list[int], list[str]]:
    """(token ids, document lengths, text names) of one sequence of `seq_len` tokens in mix `mix`: the first
    sequence `write_mix` writes from the same texts (default `document_texts()`)."""
    return MixPacker(tokenizer, seq_len, mix, document_texts() if texts is None else texts).sample()


def write_mix(out: str, tokenizer, seq_len: int, samples: int, mix: str, *, texts=None, packages=(),
              progress: bool = False) -> dict:
    """Write `samples` sequences of mix `mix` as an MDS folder at `out` (written aside, then renamed into place:
    a stopped run leaves no folder). A finished folder of the same request is kept as it is; any other existing
    `out` is refused. progress: a progress bar over the sequences (stderr). Returns the summary it saves as
    out/mix.json."""
    if samples < 1:
        raise MtrainError(f"--samples must be at least 1; got {samples}")
    request = {"seq_len": seq_len, "samples": samples, "mix": mix, "packages": list(packages)}
    summary_path = os.path.join(out, "mix.json")
    if os.path.exists(out):
        if os.path.exists(summary_path):
            with open(summary_path) as fh:
                done = json.load(fh)
            if {k: done.get(k) for k in request} == request:
                return done
        raise MtrainError(f"{out} exists and is not this request's mix; give another --out or remove it")
    import numpy as np

    from mtrain.data.mds import mds_writer

    packer = MixPacker(tokenizer, seq_len, mix, document_texts(packages) if texts is None else texts)
    tmp = f"{out}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        writer = mds_writer(tmp, COLUMNS, compression=None, size_limit=None)
        names = []
        from tqdm.auto import tqdm

        for _ in tqdm(range(samples), desc=f"docmix {mix} {seq_len}", unit="seq", disable=not progress):
            ids, lengths, doc_names = packer.sample()
            ends = np.cumsum(lengths)
            spans = np.stack([ends - np.asarray(lengths), ends], axis=1)
            writer.write({"input_ids": np.asarray(ids, dtype=np.uint32), "indices": spans.astype(np.uint32),
                          "domain": mix, "length": seq_len})
            names.append(doc_names)
        writer.finish()
        summary = {**request, "document_lengths": packer.lengths, "repeats": packer.repeats, "documents": names}
        with open(os.path.join(tmp, "mix.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary


def add_arguments(ap) -> None:
    """The arguments of `mtrain docmix` and `python -m mtrain.data.docmix`."""
    ap.add_argument("--tokenizer", required=True, help="the model's folder (its tokenizer)")
    ap.add_argument("--seq-len", type=int, required=True, help="tokens per sequence, e.g. 131072")
    ap.add_argument("--samples", type=int, required=True, help="sequences to write (a training run's steps)")
    ap.add_argument("--mix", choices=MIXES, default="long", help="long: 41/31/19/9%% documents; short: 16 equal")
    ap.add_argument("--out", required=True, help="output folder (written aside, then renamed into place)")
    ap.add_argument("--packages", default="", help="installed packages added as code repositories (comma-separated)")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run(args) -> int:
    """`mtrain docmix`: check the request, then write the mix (`write_mix`)."""
    for flag, value in (("--seq-len", args.seq_len), ("--samples", args.samples)):
        if value < 1:
            raise MtrainError(f"{flag} must be a positive integer; got {value}")
    mix_lengths(args.seq_len, args.mix)  # the mix's own divisibility and size checks, before any tokenizer loads
    if not os.path.isdir(args.tokenizer):
        raise MtrainError(f"--tokenizer {args.tokenizer}: no such folder; give the model's folder (e.g. "
                          "models/smollm2-135m from `make real-model`)")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise MtrainError(f"--out {args.out} is a file; choose a new folder")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    packages = [p.strip() for p in args.packages.split(",") if p.strip()]
    summary = write_mix(args.out, tokenizer, args.seq_len, args.samples, args.mix, packages=packages,
                        progress=args.progress)
    print(f"{args.out}: {summary['samples']} sequences of {summary['seq_len']} tokens, documents "
          f"{summary['document_lengths']}, {summary['repeats']} from text already used")
    return 0


def main(argv=None) -> int:
    import argparse

    from mtrain.offline import set_offline

    set_offline(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m mtrain.data.docmix", description=DESCRIPTION)
    add_arguments(ap)
    try:
        return run(ap.parse_args(argv))
    except MtrainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


DESCRIPTION = ("Write sequences of real long documents in a fixed mix (document lengths as shares of the sequence: "
               "long 41/31/19/9%, short 16 equal) as an MDS folder for `mtrain train` (data.document_masking: true).")


if __name__ == "__main__":
    raise SystemExit(main())

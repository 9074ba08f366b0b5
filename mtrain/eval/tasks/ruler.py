"""RULER's 13 tasks (NVIDIA/RULER): eight needle variants, variable tracking, common/frequent words, two QA sets.

Templates, needle formats and task settings follow RULER's synthetic.yaml and constants.py (base-model prompt =
template + answer prefix); haystacks are sized with the model's tokenizer so prompt + tokens_to_generate fits.
"""

from __future__ import annotations

import random
import string

from mtrain.errors import MtrainError
from mtrain.eval.prompting import fit_largest
from mtrain.eval.registry import BuildContext, Sample, Task, register
from mtrain.eval.tasks.haystack import needle_prompt
from mtrain.eval.text import check_essays, key_word, number_value, read_json, require_path, uuid_value, word_lists

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
    " The special magic {type_needle_v} for {query} mentioned in the provided text are"
)
# RULER samples needle depths from 40 evenly spaced percentages
DEPTHS = [round(100 * i / 39) for i in range(40)]

# name -> (haystack, key type, value type, keys, values per key, queried keys), as in RULER's synthetic.yaml
NIAH_CONFIGS = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 1, 1, 4),
}


def _random_item(kind: str, rng: random.Random) -> str:
    if kind == "words":
        return key_word(rng)
    if kind == "numbers":
        return number_value(rng, 7)
    return uuid_value(rng)


def _niah_builder(haystack_default: str, key_kind: str, value_kind: str, n_keys: int, n_values: int, n_queries: int):
    n_keys = max(n_keys, n_queries)
    template, type_v = NIAH_TEMPLATE, value_kind
    if n_queries * n_values == 1:  # RULER's singular wording for one expected answer
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        type_v = value_kind[:-1]

    def build(ctx: BuildContext, length: int, index: int) -> Sample:
        rng = ctx.rng(length, index)
        haystack = ctx.params["haystack"]
        keys, values, needles = [], [], []
        for _ in range(n_keys):
            keys.append(_random_item(key_kind, rng))
            values.append([_random_item(value_kind, rng) for _ in range(n_values)])
            needles += [NEEDLE.format(type_needle_v=value_kind, key=keys[-1], value=v) for v in values[-1]]
        rng.shuffle(needles)
        queried = rng.sample(range(n_keys), n_queries)
        query = keys[queried[0]] if n_queries == 1 else (
            ", ".join(keys[i] for i in queried[:-1]) + ", and " + keys[queried[-1]])
        answers = [v for i in queried for v in values[i]]
        depths = [d / 100 for d in rng.sample(DEPTHS, len(needles))] if haystack == "essay" else None
        ids, meta, _ = needle_prompt(
            ctx, length, ctx.params["max_new_tokens"], haystack=haystack, rng=rng, needles=needles, depths=depths,
            make_prompt=lambda context: template.format(type_needle_v=type_v, context=context, query=query),
            distractor=lambda r: NEEDLE.format(type_needle_v=value_kind, key=_random_item(key_kind, r),
                                               value=_random_item(value_kind, r)),
        )
        return Sample(index, length, ids, answers, meta)

    return build, {"haystack": haystack_default}


# ---- variable tracking ----

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
    # RULER's answer prefix, its spelling kept
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assgined "
    "the value {query}, they are: "
)


def _chains(rng: random.Random, num_chains: int, num_hops: int, name_len: int) -> tuple[list, list]:
    """(variable names, assignment statements) per chain: VAR A = 12345, then VAR B = VAR A, ... (RULER's vt)."""
    names: list[str] = []
    while len(names) < num_chains * (num_hops + 1):
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(name_len))
        if name not in names:
            names.append(name)
    variables, chains = [], []
    for c in range(num_chains):
        chain_vars = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        statements = [f"VAR {chain_vars[0]} = {rng.randint(10000, 99999)}"]
        statements += [f"VAR {chain_vars[j + 1]} = VAR {chain_vars[j]}" for j in range(num_hops)]
        variables.append(chain_vars)
        chains.append(statements)
    return variables, chains


def _vt_prompt(ctx, length, max_new, rng, num_chains, num_hops, name_len, prefix):
    variables, chains = _chains(rng, num_chains, num_hops, name_len)
    value = chains[0][0].split("=")[-1].strip()
    needles, depths = [], []
    for chain in chains:  # each chain's statements in order at random places
        needles += chain
        depths += sorted(rng.random() for _ in chain)
    ids, meta, text = needle_prompt(
        ctx, length, max_new, haystack="noise", rng=rng, needles=needles, depths=depths,
        make_prompt=lambda context: prefix + VT_TEMPLATE.format(context=context, query=value, num_v=num_hops + 1),
    )
    return ids, text, variables[0], meta


def build_vt(ctx: BuildContext, length: int, index: int) -> Sample:
    rng = ctx.rng(length, index)
    hops, chains = int(ctx.params["num_hops"]), int(ctx.params["num_chains"])
    # RULER prepends one solved example of at most 500 tokens, with 3-letter names
    _, icl_text, icl_answer, _ = _vt_prompt(ctx, 500, 30, rng, chains, min(10, hops), 3, "")
    icl = icl_text + " " + " ".join(icl_answer) + "\n\n"
    ids, _, answer, meta = _vt_prompt(ctx, length, ctx.params["max_new_tokens"], rng, chains, hops, 5, icl)
    return Sample(index, length, ids, answer, meta)


# ---- common words extraction ----

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
    "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
    " Answer: The top 10 words that appear most often in the list are:"
)


def _cwe_pool(ctx: BuildContext, need: int) -> list[str]:
    """The word pool, sorted then shuffled by the seed.

    words: wonderwords (RULER's: nouns + adjectives + verbs; past its ~8.7K words, adjective+noun compounds stand
    in for RULER's english_words.json) or tokenizer (pairs of the tokenizer's own whole-word tokens: for tiny
    tokenizers, on which a dictionary word costs ~9 tokens and RULER's lists do not fit short lengths).
    """
    source = ctx.params["words"]
    if source == "wonderwords":
        lists = word_lists()
        pool = sorted(set(lists["noun"] + lists["adjective"] + lists["verb"]))
        first, second = lists["adjective"], lists["noun"]
    elif source == "tokenizer":
        pieces = {ctx.tokenizer.decode([i]) for i in range(len(ctx.tokenizer))}
        first = second = sorted(p[1:] for p in pieces if p.startswith(" ") and p[1:].isalpha() and p[1:].islower()
                                and len(p) >= 4)
        if len(first) < 20:
            raise MtrainError(f"cwe words: tokenizer has only {len(first)} whole-word tokens; use words: wonderwords")
        pool = []
    else:
        raise MtrainError(f"cwe words must be wonderwords or tokenizer, got {source!r}")
    random.Random(ctx.seed).shuffle(pool)
    seen = set(pool)
    rng = random.Random(f"cwe-extra/{ctx.seed}")
    limit = len(pool) + len(first) * len(second)
    while len(pool) < min(need, limit):
        word = rng.choice(first) + rng.choice(second)
        if word not in seen:
            seen.add(word)
            pool.append(word)
    return pool


def _cwe_list(pool: list[str], n_words: int, n_common: int, common_reps: int, rare_reps: int, seed: float):
    rng = random.Random(seed)
    chosen = rng.sample(pool, n_words)
    common, rare = chosen[:n_common], chosen[n_common:]
    items = common * common_reps + rare * rare_reps
    rng.shuffle(items)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), common


def build_cwe(ctx: BuildContext, length: int, index: int) -> Sample:
    rng = ctx.rng(length, index)
    p = ctx.params
    n_common = int(p["num_cw"])
    # RULER's lighter setting below 4K tokens (`light_below`): a 20-word example at 3/1 repeats and 6/1 in the task
    if length < int(p["light_below"]):
        example_args, common_reps, rare_reps = (20, 3, 1), 6, 1
    else:
        example_args, common_reps, rare_reps = (40, 10, 3), int(p["freq_cw"]), int(p["freq_ucw"])
    budget = length - p["max_new_tokens"]
    pool_key = f"cwe-pool/{budget}"
    if pool_key not in ctx.memo:
        ctx.memo[pool_key] = _cwe_pool(ctx, budget // max(1, rare_reps))
    pool = ctx.memo[pool_key]
    example_context, example_answer = _cwe_list(pool, example_args[0], n_common, example_args[1], example_args[2],
                                                rng.random())
    example = CWE_TEMPLATE.format(context=example_context) + " " + " ".join(
        f"{i + 1}. {w}" for i, w in enumerate(example_answer))
    list_seed = rng.random()

    def make_ids(n: int) -> list[int]:
        context, _ = _cwe_list(pool, n_common + n, n_common, common_reps, rare_reps, list_seed)
        return ctx.encode(example + "\n" + CWE_TEMPLATE.format(context=context))

    n_rare, ids = fit_largest(make_ids, budget, ctx.memo.get(f"fit/cwe/{length}", 16), upper=len(pool) - n_common)
    ctx.memo[f"fit/cwe/{length}"] = n_rare
    _, common = _cwe_list(pool, n_common + n_rare, n_common, common_reps, rare_reps, list_seed)
    return Sample(index, length, ids, common, {"words": n_common + n_rare})


# ---- frequent words extraction ----

FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
    " Answer: According to the coded text above, the three most frequently appeared words are:"
)


def zeta(alpha: float, terms: int = 1000) -> float:
    """Riemann zeta for alpha > 1: a partial sum plus the Euler-Maclaurin tail (error far below 1e-9)."""
    if alpha <= 1:
        raise MtrainError(f"fwe alpha must be > 1, got {alpha}")
    head = sum(k ** -alpha for k in range(1, terms))
    return head + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms ** -alpha + alpha * terms ** (-alpha - 1) / 12


def build_fwe(ctx: BuildContext, length: int, index: int) -> Sample:
    rng = ctx.rng(length, index)
    alpha = float(ctx.params["alpha"])
    budget = length - ctx.params["max_new_tokens"]
    vocab_size = max(4, budget // 50)  # RULER's default vocabulary size
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choice(string.ascii_lowercase) for _ in range(6)))
    words = sorted(vocab)
    rng.shuffle(words)
    words[0] = "..."  # the most frequent "word" is noise, as in RULER
    norm = zeta(alpha)
    shuffle_seed = rng.random()

    def make_ids(n: int) -> list[int]:
        counts = [int(n * (k ** -alpha) / norm) for k in range(1, len(words) + 1)]
        text = [w for w, c in zip(words, counts) for _ in range(c)]
        random.Random(shuffle_seed).shuffle(text)
        return ctx.encode(FWE_TEMPLATE.format(context=" ".join(text)))

    n, ids = fit_largest(make_ids, budget, ctx.memo.get(f"fit/fwe/{length}", budget // 4))
    ctx.memo[f"fit/fwe/{length}"] = n
    return Sample(index, length, ids, words[1:4], {"words": n})


# ---- question answering over documents (SQuAD, HotpotQA) ----

QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    "\n\nThe following are given documents.\n\n{context}\n\n"
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    "\n\nQuestion: {query} Answer:"
)


def read_squad(path: str) -> tuple[list[dict], list[str]]:
    """RULER's reading of SQuAD (v2 dev): answerable questions, their paragraph and the article's other paragraphs."""
    data = read_json(path, "squad", "squad_path")
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    doc_id = {c: i for i, c in enumerate(docs)}
    qas = []
    for article in data["data"]:
        article_docs = [doc_id[p["context"]] for p in article["paragraphs"]]
        for para in article["paragraphs"]:
            own = doc_id[para["context"]]
            for qa in para["qas"]:
                if not qa.get("is_impossible", False):
                    qas.append({"query": qa["question"], "outputs": [a["text"] for a in qa["answers"]],
                                "context": [own], "more_context": [i for i in article_docs if i != own]})
    return qas, docs


def read_hotpotqa(path: str) -> tuple[list[dict], list[str]]:
    """RULER's reading of HotpotQA (dev distractor): each question's paragraphs are its gold documents."""
    data = read_json(path, "hotpotqa", "hotpotqa_path")
    docs = sorted({f"{title}\n{''.join(sents)}" for d in data for title, sents in d["context"]})
    doc_id = {c: i for i, c in enumerate(docs)}
    qas = [{"query": d["question"], "outputs": [d["answer"]],
            "context": [doc_id[f"{t}\n{''.join(s)}"] for t, s in d["context"]], "more_context": []} for d in data]
    return qas, docs


def _qa_data(ctx: BuildContext, reader, key: str):
    if "qa" not in ctx.memo:
        ctx.memo["qa"] = reader(ctx.params.get(key))
    return ctx.memo["qa"]


def _qa_builder(reader, key: str):
    def count(ctx: BuildContext, length: int, requested: int) -> int:
        return min(requested, len(_qa_data(ctx, reader, key)[0]))

    def build(ctx: BuildContext, length: int, index: int) -> Sample:
        qas, docs = _qa_data(ctx, reader, key)
        rng = ctx.rng(length, index)
        qa = qas[index]
        gold, related = list(qa["context"]), list(qa["more_context"])
        rng.shuffle(related)
        budget = length - ctx.params["max_new_tokens"]
        others_needed = min(len(docs), budget // 8)  # a document is more than 8 tokens
        excluded = set(gold) | set(related)
        others = [i for i in rng.sample(range(len(docs)), min(len(docs), others_needed + len(excluded)))
                  if i not in excluded]
        distractors = related + others  # the question's own article first, as RULER does
        order_seed = rng.random()

        def make_ids(n: int) -> list[int]:
            chosen = [docs[i] for i in gold + distractors[:n]]
            random.Random(order_seed).shuffle(chosen)
            context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(chosen))
            return ctx.encode(QA_TEMPLATE.format(context=context, query=qa["query"]))

        n, ids = fit_largest(make_ids, budget, ctx.memo.get(f"fit/qa/{length}", 4), upper=len(distractors))
        ctx.memo[f"fit/qa/{length}"] = max(1, n)
        return Sample(index, length, ids, qa["outputs"], {"documents": len(gold) + n})

    return build, count


def _register_all() -> None:
    for name, cfg in NIAH_CONFIGS.items():
        build, params = _niah_builder(*cfg)
        register(Task(name=f"ruler/{name}", family="ruler", kind="generate", metric="string_match_all",
                      max_new_tokens=128, stop=(), build=build, default_params=params, check_data=check_essays,
                      source="offline" if cfg[0] != "essay" else "essay_path (Paul Graham essays, or synthetic)"))
    register(Task(name="ruler/vt", family="ruler", kind="generate", metric="string_match_all", max_new_tokens=30,
                  stop=(), build=build_vt, default_params={"num_chains": 1, "num_hops": 4}))
    register(Task(name="ruler/cwe", family="ruler", kind="generate", metric="string_match_all", max_new_tokens=120,
                  stop=(), build=build_cwe, default_params={"freq_cw": 30, "freq_ucw": 3, "num_cw": 10,
                                                                   "words": "wonderwords", "light_below": 4096}))
    register(Task(name="ruler/fwe", family="ruler", kind="generate", metric="string_match_all", max_new_tokens=50,
                  stop=(), build=build_fwe, default_params={"alpha": 2.0}))
    for name, reader, key, kind in (("qa_1", read_squad, "squad_path", "squad"),
                                    ("qa_2", read_hotpotqa, "hotpotqa_path", "hotpotqa")):
        build, count = _qa_builder(reader, key)
        register(Task(name=f"ruler/{name}", family="ruler", kind="generate", metric="string_match_part",
                      max_new_tokens=32, stop=(), build=build, count=count, source=key,
                      check_data=lambda p, key=key, kind=kind: require_path(p.get(key), kind, key)))


_register_all()

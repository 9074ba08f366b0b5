"""Does a stage-1 setup teach the tiny model to copy? A plain training loop and a copy probe (issue #14, item 1).

Trains the embedded default's tiny Qwen2 from scratch on copy drills (or the stage-1 retrieval mix) and prints the
loss and held-out copy accuracy as it goes; docs/history.md, "How the copy curriculum was found" and "What was tried before
the copy curriculum" list the settings tried and what each gave. Not part of `make train`: a quick way to search
for a setup before moving it into the recipes.

    python -m tools.induction_probe --rows 128 --batch 4 --lr 3e-3 --steps 4000 --every 500 --prev-token-head
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

import torch
from transformers import Qwen2ForCausalLM

from mtrain.data import synthetic as S
from mtrain.tiny import load_tokenizer, tiny_config


def drill(rng: random.Random, min_words: int, max_words: int) -> str:
    """Random words (a 7-digit number among them half the time), said 2-3 times on separate lines."""
    words = [rng.choice(S.WORDS) for _ in range(rng.randint(min_words, max_words))]
    if rng.random() < 0.5:
        words.insert(rng.randint(0, len(words)), S.random_number(rng, 7))
    return "\n".join([" ".join(words)] * rng.randint(2, 3))


def set_previous_token_head(model, gap: float = 10.0, pairs: int = 8) -> None:
    """Make layer 0's first query head attend to the previous token, through q/k biases alone.

    RoPE turns constant q and k into a score sum_i cos(theta_i * (1 - (m - n))) over the `pairs` fastest
    rotary pairs: largest at m - n = 1; `gap` is its margin in logits over the next best offsets (0 and 2).
    """
    cfg, attn = model.config, model.model.layers[0].self_attn
    hd = cfg.head_dim
    theta = [cfg.rope_parameters["rope_theta"] ** (-2 * i / hd) for i in range(hd // 2)]
    margin = sum(1 - math.cos(t) for t in theta[:pairs])  # score(1) - score(0) per unit amplitude squared
    amp = math.sqrt(gap / (margin * hd**-0.5))
    with torch.no_grad():
        for i in range(pairs):  # HF's rotary pairs dims i and i + hd/2
            attn.q_proj.bias[i], attn.q_proj.bias[i + hd // 2] = amp, 0.0
            attn.k_proj.bias[i] = amp * math.cos(theta[i])
            attn.k_proj.bias[i + hd // 2] = amp * math.sin(theta[i])


def copy_accuracy(model, tok, docs: list[tuple[list[int], int]]) -> float:
    """Argmax accuracy on the tokens from each doc's `start` on (its repeated part)."""
    right = total = 0
    with torch.no_grad():
        for ids, start in docs:
            x = torch.tensor([ids])
            pred = model(x).logits[0, :-1].argmax(-1)
            right += int((pred[start:] == x[0, 1:][start:]).sum())
            total += len(ids) - 1 - start
    return right / total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", choices=("drills", "mix"), default="drills",
                   help="short copy drills, or the stage-1 retrieval mix (mtrain.data.synthetic --retrieval 1)")
    p.add_argument("--min-words", type=int, default=3)
    p.add_argument("--max-words", type=int, default=10)
    p.add_argument("--rows", type=int, default=128, help="tokens per row (documents packed, no masking)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--cosine", action="store_true", help="decay to 0.1 x lr (default: constant after warmup)")
    p.add_argument("--prev-token-head", action="store_true", help="set a previous-token head at init")
    p.add_argument("--config", default="{}", help="tiny config overrides as JSON, e.g. '{\"hidden_size\": 256}'")
    p.add_argument("--every", type=int, default=500)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is far faster on a shared box)")
    p.add_argument("--save", help="folder for the final model")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok = load_tokenizer()
    model = Qwen2ForCausalLM(tiny_config(**json.loads(args.config)))
    if args.prev_token_head:
        set_previous_token_head(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))

    rng, buf = random.Random(0), []
    spec = S.CorpusSpec(min_sentences=1, max_sentences=80, facts_per_doc=4, retrieval=1)

    def next_doc() -> list[int]:
        text = (drill(rng, args.min_words, args.max_words) if args.data == "drills"
                else S.make_retrieval_document(rng, spec))
        return tok.encode(text) + [tok.eos_token_id]

    def batch() -> torch.Tensor:
        rows = []
        for _ in range(args.batch):
            while len(buf) < args.rows:
                buf.extend(next_doc())
            rows.append(buf[:args.rows])
            del buf[:args.rows]
        return torch.tensor(rows)

    probe_rng = random.Random(123)
    probes = {}
    for n in (6, 10, 30):  # short drills: copies about 14, 21 and 41 tokens apart
        docs = []
        for _ in range(20):
            words = [probe_rng.choice(S.WORDS) for _ in range(n)]
            words.insert(probe_rng.randint(0, n), S.random_number(probe_rng, 7))
            line = " ".join(words)
            docs.append((tok.encode(line + "\n" + line), len(tok.encode(line)) + 1))
        probes[f"drill{n}"] = docs

    t0, losses = time.time(), []
    for step in range(1, args.steps + 1):
        decay = 0.1 + 0.45 * (1 + math.cos(math.pi * step / args.steps)) if args.cosine else 1.0
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, step / args.warmup) * decay
        x = batch()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step % args.every == 0:
            model.eval()
            accs = " ".join(f"{k} {copy_accuracy(model, tok, v):.2f}" for k, v in probes.items())
            model.train()
            print(f"step {step} loss {sum(losses) / len(losses):.3f} copy acc: {accs} ({time.time() - t0:.0f} s)",
                  flush=True)
            losses = []
    if args.save:
        model.save_pretrained(args.save)
        tok.save_pretrained(args.save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

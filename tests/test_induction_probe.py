"""tools/induction_probe.py: the previous-token head it sets at init, and its copy drills."""

import random
import sys
from pathlib import Path

import torch

from mtrain.tiny import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ is not installed: the repository root
from tools import induction_probe  # noqa: E402


def test_previous_token_head_attends_to_the_previous_token():
    model = build_tiny_model(seed=0, _attn_implementation="eager")
    induction_probe.set_previous_token_head(model)
    x = torch.randint(1, 1000, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        attn = model(x, output_attentions=True).attentions[0][0]  # layer 0: [heads, S, S]
    prev = attn[:, torch.arange(1, 300), torch.arange(0, 299)]  # each row's weight on the token before it
    assert prev[0].min() > 0.95  # the head set at init, at every position up to 300
    assert prev[1:].mean() < 0.2  # the other heads are left as initialised


def test_drill_repeats_one_line():
    text = induction_probe.drill(random.Random(0), 3, 10)
    lines = text.split("\n")
    assert 2 <= len(lines) <= 3 and len(set(lines)) == 1 and 3 <= len(lines[0].split()) <= 11

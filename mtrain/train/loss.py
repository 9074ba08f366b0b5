"""LM loss without [S, vocab] logits: the head and cross-entropy run in recomputed token chunks.

Returns the *sum* of token losses and the count of valid tokens, so the caller normalises by the
global count (over a whole context-parallel group and all micro-batches), never by a local mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def chunked_lm_loss(hidden: torch.Tensor, lm_head: torch.nn.Linear, labels: torch.Tensor, chunk: int = 4096):
    """Sum of next-token cross-entropy over valid labels, and their count.

    hidden: [B, S, H] final hidden states; labels: [B, S] already aligned with `hidden` (labels[i] is the
    target for position i; -100 = ignore). Each chunk's logits are recomputed in backward, so peak
    memory is one chunk of logits, not S of them.
    """
    if hidden.shape[:2] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on [B, S]")
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_y = labels.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    starts = range(0, flat_y.numel(), chunk)
    # which chunks hold a label, in one read for all of them (a read per chunk would make the host wait for the
    # device once per chunk, between the model's forward and its backward)
    valid = flat_y != -100
    labelled = torch.nn.functional.pad(valid, (0, -valid.numel() % chunk)).view(-1, chunk).any(-1).tolist()
    for start, any_label in zip(starts, labelled):
        if not any_label:
            continue
        h, y = flat_h[start : start + chunk], flat_y[start : start + chunk]
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss_sum, h, lm_head.weight, lm_head.bias, y, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(h, lm_head.weight, lm_head.bias, y)
    return total, valid.sum()


class ChunkedLossLM(torch.nn.Module):
    """A causal LM whose forward returns (sum of token losses, valid-token count) without full logits.

    Wrapping the HF model in one module lets DDP / DeepSpeed see the whole forward (they hook it to
    reduce gradients) while the LM head and cross-entropy still run chunk by chunk.
    """

    def __init__(self, model: torch.nn.Module, chunk: int = 4096):
        super().__init__()
        self.model = model
        self.chunk = chunk

    def forward(self, input_ids, position_ids, labels, attention_mask=None):
        hidden = self.model.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                          attention_mask=attention_mask, use_cache=False).last_hidden_state
        return chunked_lm_loss(hidden, self.model.get_output_embeddings(), labels, chunk=self.chunk)

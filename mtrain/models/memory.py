"""Activation memory of long sequences, through transformers' public modules (no vendored model files):

- `chunk_mlp`: each decoder layer's MLP runs its tokens in chunks (`model.mlp_chunk`), each chunk checkpointed, so
  neither its forward nor its backward holds the [S, intermediate] tensors of the whole sequence (gate, up, the
  activation and their product: 4 x 5.4 GiB at 256K tokens on Qwen2.5-3B, 11008 wide, bf16) but one chunk's.
- `OffloadActivations`: around the forward, what autograd saves goes to pinned host memory until the backward
  reads it (`train.offload_activations`); under activation checkpointing that is each decoder layer's input, the
  one tensor a checkpointed layer keeps between its forward and its backward (1 GiB per layer at 256K tokens x
  2048, bf16).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from mtrain.config import check_mlp_chunk
from mtrain.errors import ConfigError


def decoder_layers(model) -> list:
    """The decoder layers of a HF causal LM (Qwen2 / Llama: `model.model.layers`)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ConfigError(f"{type(model).__name__} has no decoder layers at .layers: model.mlp_chunk and "
                          "train.offload_activations support Qwen2 and Llama models")
    return list(layers)


def chunked_mlp_forward(mlp_forward, chunk: int, x: torch.Tensor) -> torch.Tensor:
    """`mlp_forward` (a position-wise MLP) on x [B, S, H] in token chunks of `chunk` along S. With gradients on,
    each chunk is checkpointed: its backward recomputes that chunk's intermediates, so at most one chunk's are alive
    in either pass (the price: the MLP's forward once more per step). Same outputs and gradients as one call, up to
    the matmuls' float rounding."""
    if chunk <= 0 or x.dim() < 2 or x.shape[-2] <= chunk:
        return mlp_forward(x)
    pieces = []
    for start in range(0, x.shape[-2], chunk):
        part = x[..., start : start + chunk, :]
        if torch.is_grad_enabled():
            pieces.append(checkpoint(mlp_forward, part, use_reentrant=False, preserve_rng_state=False))
        else:
            pieces.append(mlp_forward(part))
    return torch.cat(pieces, dim=-2)


def chunk_mlp(model, chunk: int | None) -> int:
    """Run every decoder layer's `mlp` in token chunks of `chunk` (`chunked_mlp_forward`); 0 or None: unchanged.
    The MLP modules, their parameters and the state dict stay as they are (only the instance's forward is replaced,
    so checkpoints and exports are unaffected). Returns the number of layers changed."""
    check_mlp_chunk(chunk)
    if not chunk:
        return 0
    n = 0
    for layer in decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            continue
        original = getattr(mlp, "_mtrain_unchunked_forward", None) or mlp.forward
        mlp._mtrain_unchunked_forward = original
        mlp.forward = functools.partial(chunked_mlp_forward, original, chunk)
        n += 1
    return n


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Within it, what autograd saves for the backward goes to (pinned) host memory and comes back to its device
    when the backward reads it (`train.offload_activations`): `torch.autograd.graph.save_on_cpu`, but parameters
    (saved by every matmul that reads them, e.g. the LM head once per loss chunk: 622 MB each on Qwen2.5-3B) and
    tensors under `min_bytes` stay where they are. Under non-reentrant activation checkpointing a checkpointed
    layer's inputs are saved tensors of the enclosing graph (torch.utils.checkpoint saves them through autograd
    since torch 2.1): they are what moves, one [S, hidden] tensor per layer; what the layers save inside stays under
    the checkpoint's own hooks (recomputed). include_cpu: copy CPU tensors too (tests, on a machine without GPU)."""

    def __init__(self, min_bytes: int = 1 << 20, include_cpu: bool = False):
        pin = torch.cuda.is_available()

        def pack(t: torch.Tensor):
            if (isinstance(t, torch.nn.Parameter) or t.numel() * t.element_size() < min_bytes
                    or (t.device.type == "cpu" and not include_cpu)):
                return t
            host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, device="cpu",
                               pin_memory=pin and t.device.type != "cpu")
            host.copy_(t, non_blocking=host.is_pinned())
            self.moved += host.numel() * host.element_size()
            return (t.device, host)

        def unpack(packed):
            if isinstance(packed, tuple):
                device, host = packed
                return host.to(device, non_blocking=host.is_pinned())
            return packed

        self.moved = 0
        """Bytes sent to host memory so far."""
        super().__init__(pack, unpack)

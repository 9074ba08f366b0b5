"""Synthetic inputs of the benchmarks: the vertical-slash index (a local window, far slashes, scattered verticals;
`window_slash_lines`, `synthetic_index`), the band index of the cost measurements (`band_lines`) and planted
long-context q/k/v with vertical-slash structure (`make_inputs`).

Torch is imported inside the functions, so `mtrain --help` does not load it.
"""

from __future__ import annotations

import math


def window_slash_lines(seq_len: int, heads: int, *, window: int, far: int, verticals: int, seed: int = 0,
                       window_step: int = 1, far_high: int | None = None):
    """(vertical [1, heads, verticals], slash [1, heads, n]) lines of a vertical-slash index like the ones estimated
    on long-context models: per head the local window (slash offsets 0, window_step, ... below `window`), `far`
    slashes drawn from [window, far_high) (default seq_len / 2) and `verticals` columns anywhere; each head draws
    its own from one generator seeded with `seed`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    high = seq_len // 2 if far_high is None else far_high
    local = torch.arange(0, window, window_step)
    slashes, columns = [], []
    for _ in range(heads):
        slashes.append(torch.cat([local, torch.randint(window, high, (far,), generator=g)]))
        columns.append(torch.randint(0, seq_len, (verticals,), generator=g))
    return torch.stack(columns)[None], torch.stack(slashes)[None]


def far_for_density(seq_len: int, block_size: int, window: int, density: float) -> int:
    """Far slashes per head that make about `density` of the causal blocks with the local window: a far slash
    crosses about two key blocks in the rows it reaches; with offsets uniform in [window, S/2) that is 3/4 of the
    rows; the mean causal row holds n_blocks / 2 blocks."""
    n_blocks = seq_len // block_size
    window_blocks = -(-window // block_size) + 1
    return max(0, int((density * n_blocks / 2 - window_blocks - 1) / (2 * 0.75)))


def synthetic_index(seq_len: int, *, block_size: int, window: int, density: float, verticals: int, heads: int = 1,
                    seed: int = 0):
    """The SparseIndex of `window_slash_lines` with as many far slashes as make `density` of the causal blocks
    (`far_for_density`), seeded with seed + seq_len."""
    from mtrain.ops import SparseIndex

    far = far_for_density(seq_len, block_size, window, density)
    vertical, slash = window_slash_lines(seq_len, heads, window=window, far=far, verticals=verticals,
                                         seed=seed + seq_len)
    return SparseIndex.from_lines(vertical, slash, seq_len, block_size)


def band_lines(S: int, Hq: int, bs: int, frac: float, n_vert: int, device="cpu"):
    """(vertical, slash) lines giving about `frac` of the causal key blocks: a local band of block-aligned slashes
    plus `n_vert` vertical columns spread evenly over the sequence, the same for every head."""
    import torch

    n = -(-S // bs)
    width = max(1, int(frac * (n + 1) / 2))
    slash = (torch.arange(width, device=device) * bs).expand(1, Hq, -1).contiguous()
    vert = torch.linspace(bs, S - 1, max(n_vert, 1), device=device).long()[:n_vert]
    vert = vert.expand(1, Hq, -1).contiguous() if n_vert else torch.empty(1, Hq, 0, dtype=torch.long, device=device)
    return vert, slash


def rope(x, theta: float = 1e6):
    """Rotary embedding (half-split convention, as in Qwen2/Llama) of x [B, S, H, D] at positions 0..S-1."""
    import torch

    B, S, H, D = x.shape
    inv = theta ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    ang = torch.arange(S, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def make_inputs(S, Hq=16, Hkv=2, D=128, seed=0, device="cuda", dtype=None):
    """RoPE'd queries/keys with vertical-slash structure (logits of 15-30 over a small noise floor, like
    trained heads): a shared per-kv-head direction in the fast-rotating RoPE dims (a local window with
    ripples), 4 attention sinks, 32 outlier keys per kv head (verticals), and 3 periodic offsets per
    query head planted as q_t += 0.8 k_{t-d} (slashes; periods 256..2048, shifted per head)."""
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    g = torch.Generator(device=device).manual_seed(seed)
    G = Hq // Hkv

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32)

    def unit(*shape):
        x = randn(*shape)
        return x / x.norm(dim=-1, keepdim=True) * math.sqrt(shape[-1])

    fast = 16  # RoPE pairs 0..15 turn at least once every ~200 tokens
    u = torch.zeros(1, 1, Hkv, D, device=device)
    u[..., :fast] = randn(1, 1, Hkv, fast)
    u[..., D // 2 : D // 2 + fast] = randn(1, 1, Hkv, fast)
    u = u / u.norm(dim=-1, keepdim=True) * math.sqrt(D)
    k = rope(u.expand(1, S, Hkv, D).contiguous()) + 0.5 * randn(1, S, Hkv, D)
    q = rope(u.repeat_interleave(G, 2).expand(1, S, Hq, D).contiguous()) + 0.5 * randn(1, S, Hq, D)
    w = unit(1, 1, Hkv, D)
    k[:, :4] += 3 * w
    q += 0.5 * w.repeat_interleave(G, 2)
    w2 = unit(1, 1, Hkv, D)
    for h in range(Hkv):
        idx = torch.randint(4, S, (32,), generator=g, device=device)
        k[:, idx, h] += 3 * w2[:, :, h]
    q += 0.4 * w2.repeat_interleave(G, 2)
    planted = k.clone()
    for h in range(Hq):
        period = [256, 512, 1024, 2048][h % 4]
        for m in range(1, 4):
            d = period * m + 17 * (h // 4)
            if d < S:
                q[:, d:, h] += 0.8 * planted[:, : S - d, h // G]
    v = randn(1, S, Hkv, D)
    return (1.6 * q).to(dtype), k.to(dtype), v.to(dtype)

"""Plots of the eval stage: the NIAH depth x length heatmap and the PG-19 perplexity-vs-length curve.

matplotlib with the Agg backend, so they render on headless machines.
"""

from __future__ import annotations


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _length_label(length: str) -> str:
    return f"{int(length) // 1024}K" if int(length) % 1024 == 0 else str(length)


NIAH_TITLE = "Needle in a haystack: answer found (%)"


def niah_figure(grid: dict[str, dict[str, float]]):
    """The NIAH heatmap's matplotlib figure: depth (rows) x length (columns), score 0-100 per cell.

    A grid of one or two lengths makes a narrow figure: the title then breaks over lines (and the figure
    keeps a minimum width) so it is never cut off.
    """
    plt = _pyplot()
    lengths = sorted(grid, key=int)
    depths = sorted({d for cells in grid.values() for d in cells}, key=float)
    values = [[grid[L].get(d, float("nan")) for L in lengths] for d in depths]
    width = max(3.2, 1.2 + 0.9 * len(lengths))
    fig, ax = plt.subplots(figsize=(width, 1.2 + 0.5 * len(depths)))
    image = ax.imshow(values, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    ax.set_xticks(range(len(lengths)), [_length_label(L) for L in lengths])
    ax.set_yticks(range(len(depths)), [f"{float(d):g}%" for d in depths])
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(NIAH_TITLE if width >= 5 else NIAH_TITLE.replace(": ", ":\n"))
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    return fig


def niah_heatmap(grid: dict[str, dict[str, float]], path: str) -> None:
    """Write the NIAH heatmap (`niah_figure`) as a PNG."""
    plt = _pyplot()
    fig = niah_figure(grid)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def perplexity_curve(by_length: dict[str, dict], path: str) -> None:
    """Perplexity against evaluated length (log-2 x axis)."""
    plt = _pyplot()
    lengths = sorted(by_length, key=int)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([int(L) for L in lengths], [by_length[L]["score"] for L in lengths], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xticks([int(L) for L in lengths], [_length_label(L) for L in lengths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title("PG-19-style perplexity vs length")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

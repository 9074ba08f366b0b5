"""Loss curves of the fidelity study (issue #14): two runs' metrics.jsonl on the same tokens, a moving average of
the training loss (one 32K sample per step, so single steps are noisy) and the per-step difference mtraining -
dense in nats (a ratio spikes on the near-zero losses of needle-heavy samples).

    python -m tools.plot_fidelity MTRAINING/metrics.jsonl DENSE/metrics.jsonl --out docs/fidelity-smollm2-32k.png
"""

from __future__ import annotations

import argparse


def losses(path: str) -> dict[int, float]:
    from mtrain.train.metrics import read_metrics

    # a torn last line (a run still writing, or killed) is skipped, as everywhere metrics.jsonl is read
    return {int(row["step"]): float(row["loss"]) for row in read_metrics(path)
            if isinstance(row, dict) and "step" in row and "loss" in row}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mtraining")
    p.add_argument("dense")
    p.add_argument("--window", type=int, default=20, help="moving-average window in steps")
    p.add_argument("--title", default="SmolLM2-135M 8K->32K, H200: MTraining vs dense on the same tokens")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, d = losses(a.mtraining), losses(a.dense)
    steps = sorted(set(m) & set(d))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=(2, 1))
    for name, series, color in (("mtraining", m, "tab:blue"), ("dense", d, "tab:orange")):
        y = [series[s] for s in steps]
        top.plot(steps, y, color=color, alpha=0.15, lw=0.8)
        w = a.window
        avg = [sum(y[max(0, i - w + 1):i + 1]) / len(y[max(0, i - w + 1):i + 1]) for i in range(len(y))]
        top.plot(steps, avg, color=color, lw=1.8, label=f"{name} ({w}-step mean)")
    top.set_ylabel("training loss")
    top.legend()
    top.set_title(a.title, fontsize=10)
    top.grid(alpha=0.3)
    diff = [m[s] - d[s] for s in steps]
    bottom.plot(steps, diff, color="tab:green", lw=1)
    bottom.axhline(0, color="black", lw=0.6)
    bottom.set_ylabel("mtraining - dense (nats)")
    bottom.set_xlabel("optimizer step (32,768 tokens each)")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out, dpi=100)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

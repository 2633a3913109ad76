"""The loss curve: `loss.jsonl` records -> a PNG (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over `window` values (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_loss(records: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Per-step loss (faint) and its moving average, written to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in records]
    loss = [float(r["loss"]) for r in records]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        ax.plot(steps, loss, color="tab:blue", alpha=0.3, linewidth=0.8, label="loss")
        window = max(1, len(loss) // 50)
        if window > 1:
            ax.plot(steps, smooth(loss, window), color="tab:blue", label=f"mean of {window}")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)

"""Reliability diagrams of confidence estimates (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

# A headless backend, selected before pyplot is imported: plots are written by training jobs and CI, which
# have no display.
matplotlib.use("Agg")
import matplotlib.pyplot as plt

from services.calibration_metrics import reliability_curve


def plot_reliability(
    curves: Mapping[str, Mapping[int, tuple[Any, Any]]],
    path: str | Path,
    bins: int = 20,
    title: str = "",
) -> None:
    """Reliability diagram: one subplot per series (e.g. "raw", "calibrated"), one line per draft position k.

    `curves[series][k] = (probs, labels)` with probs the predicted prefix survival a_k and labels whether
    draft positions 1..k were all accepted. Writes a PNG to `path`.
    """
    if not curves:
        raise ValueError("plot_reliability needs at least one series")
    names = list(curves)
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4.6), squeeze=False, sharey=True)
    try:
        for ax, name in zip(axes[0], names, strict=True):
            ax.plot([0.0, 1.0], [0.0, 1.0], linestyle="--", color="grey", linewidth=1, label="y=x")
            for k in sorted(curves[name]):
                probs, labels = curves[name][k]
                points = reliability_curve(probs, labels, bins)
                if not points:
                    continue
                _, mean_pred, mean_label, _ = zip(*points, strict=True)
                ax.plot(mean_pred, mean_label, marker="o", markersize=3, linewidth=1, label=f"k={k}")
            ax.set_xlim(0.0, 1.0)
            ax.set_ylim(0.0, 1.0)
            ax.set_aspect("equal")
            ax.set_title(name)
            ax.set_xlabel("predicted prefix survival a_k")
            ax.set_ylabel("observed prefix acceptance")
            ax.legend(fontsize="x-small", loc="upper left")
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)

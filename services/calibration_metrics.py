"""Calibration metrics for binary probability estimates: ECE, AUROC, Brier, reliability curves.

Pure numpy, no serving dependencies (the diagram is `training/eval/plots.py`), so offline fitting scripts,
benchmarks and tests share one definition. Every function accepts numpy arrays, torch tensors or lists.

Binning convention (shared with the vectorised search in `drafter_worker.calibration`): `bins`
equal-width bins on [0, 1], a probability p falls in bin min(int(p * bins), bins - 1), so p = 1.0
lands in the last bin.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def _as_array(values: Any) -> np.ndarray:
    """A flat float64 copy of an array, tensor or list; torch tensors are detached and moved to CPU first."""
    if hasattr(values, "detach"):
        values = values.detach().cpu()
    return np.asarray(values, dtype=float).reshape(-1)


def _pair(probs: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    p, y = _as_array(probs), _as_array(labels)
    if p.shape != y.shape:
        raise ValueError(f"probs and labels differ in size: {p.size} vs {y.size}")
    return p, y


def _bin_index(p: np.ndarray, bins: int) -> np.ndarray:
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    # Truncation equals floor for p in [0, 1]; the clip keeps p = 1.0 (and stray values) in range.
    return np.clip((p * bins).astype(np.int64), 0, bins - 1)


def ece(probs: Any, labels: Any, bins: int = 20) -> float:
    """Expected calibration error: sum over non-empty bins of count/N * |mean(p) - mean(label)|; 0.0 when empty."""
    p, y = _pair(probs, labels)
    if p.size == 0:
        return 0.0
    idx = _bin_index(p, bins)  # [N]
    # count/N * |mean p - mean y| = |sum p - sum y| / N, so one signed sum per bin suffices.
    gap = np.bincount(idx, weights=p - y, minlength=bins)  # [bins]
    return float(np.abs(gap).sum() / p.size)


def brier(probs: Any, labels: Any) -> float:
    """Mean squared error between probabilities and 0/1 labels; nan when empty."""
    p, y = _pair(probs, labels)
    if p.size == 0:
        return math.nan
    return float(np.mean((p - y) ** 2))


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of x, tied values sharing the mean of the ranks they span."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts  # [U] 0-based rank of each distinct value's first occurrence
    return (first + (counts + 1) / 2.0)[inverse]  # [N]


def auroc(probs: Any, labels: Any) -> float:
    """Area under the ROC curve via the Mann–Whitney U statistic (ties count one half); nan with one class."""
    p, y = _pair(probs, labels)
    if not np.all((y == 0) | (y == 1)):
        raise ValueError("auroc needs 0/1 labels")
    positive = y == 1
    n_pos = int(positive.sum())
    n_neg = p.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    rank_sum = _average_ranks(p)[positive].sum()
    u = rank_sum - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def reliability_curve(probs: Any, labels: Any, bins: int = 20) -> list[tuple[float, float, float, int]]:
    """(bin_center, mean_pred, mean_label, count) for every non-empty bin, in increasing bin order."""
    p, y = _pair(probs, labels)
    idx = _bin_index(p, bins)  # [N]
    count = np.bincount(idx, minlength=bins)  # [bins]
    sum_p = np.bincount(idx, weights=p, minlength=bins)  # [bins]
    sum_y = np.bincount(idx, weights=y, minlength=bins)  # [bins]
    return [
        ((b + 0.5) / bins, float(sum_p[b] / count[b]), float(sum_y[b] / count[b]), int(count[b]))
        for b in np.flatnonzero(count)
    ]

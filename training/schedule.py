"""Learning-rate schedule: linear warm-up, then cosine decay to a floor — over steps, or over a run's wall time
(a run with a time budget: its progress is the share of the budget spent, so a machine shared with other jobs
still ends its decay on time)."""

from __future__ import annotations

import math


def warmup_cosine(step: int, total: int, warmup: int, peak: float, floor_ratio: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return cosine_at(min(1.0, (step - warmup) / max(1, total - warmup)), peak, floor_ratio)


def cosine_at(progress: float, peak: float, floor_ratio: float = 0.1) -> float:
    """The cosine decay after warm-up at `progress` ∈ [0, 1]."""
    progress = min(1.0, max(0.0, progress))
    return peak * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

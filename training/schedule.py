"""Learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math


def warmup_cosine(step: int, total: int, warmup: int, peak: float, floor_ratio: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

"""Survival probabilities and the verifier's SPS(B) curve: the two quantities every verify-length rule reads."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass


def survival(confidences: Sequence[float]) -> list[float]:
    """c_1..c_γ → a_1..a_γ (cumulative products, non-increasing)."""
    out, a = [], 1.0
    for c in confidences:
        a *= c
        out.append(a)
    return out


@dataclass(frozen=True, slots=True)
class SpsCurve:
    """SPS(B) from a profiled table of (batch tokens, ms per step), linear in step time between points.

    Beyond the last point the step time grows linearly with the slope of the last two points, so the
    curve keeps falling instead of flattening at the table's edge.
    """

    batch_tokens: tuple[int, ...]  # increasing
    step_ms: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.batch_tokens) < 2 or list(self.batch_tokens) != sorted(set(self.batch_tokens)):
            raise ValueError("an SPS table needs at least two increasing batch sizes")
        if any(not (ms > 0 and math.isfinite(ms)) for ms in self.step_ms):
            raise ValueError("step times must be positive")

    def ms(self, b: int) -> float:
        xs, ys = self.batch_tokens, self.step_ms
        i = min(max(bisect.bisect_left(xs, b), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (b - x0) / (x1 - x0), 1e-6)

    def __call__(self, b: int) -> float:
        return 1000.0 / self.ms(b)

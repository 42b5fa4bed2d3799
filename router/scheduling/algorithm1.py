"""Confidence-scheduled verify lengths: DSpark's Algorithm 1 as a pure function (docs/design.md §6).

Vocabulary: R requests each hold a draft block with calibrated confidences c_{r,1..γ}; the survival
a_{r,j} = Π_{i≤j} c_{r,i} is the probability that draft j is accepted. Verifying ℓ_r drafts of request r
costs 1 + ℓ_r batch tokens (the anchor always goes); the step then emits 1 + Σ_{j≤ℓ_r} a_{r,j} tokens of r
in expectation. SPS(B) is the verifier's steps per second at B batch tokens, so the expected tokens per
second of the step is Θ = τ · SPS(B) with τ = Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j}).

Algorithm 1 admits (request, position) pairs in descending a_{r,j} (ties: smaller j first, then the
request order) and stops at the first pair that does not raise Θ. The early stop is what keeps the rule
lossless: the decision about draft x_{r,j} is taken before anything that depends on x_{r,j} (its own
c_{r,j+1}) could change it; a search that picks the best prefix in hindsight is biased.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
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


def schedule(survivals: Mapping[str, Sequence[float]], sps: Callable[[int], float],
             other_tokens: int = 0) -> dict[str, int]:
    """Algorithm 1 → verify length ℓ_r per request.

    `survivals` maps each request to a_{r,1..γ_r}; `other_tokens` are batch tokens the step carries
    anyway (e.g. prefill chunks of other requests), which shift B without adding to τ.
    """
    lengths = dict.fromkeys(survivals, 0)
    order = {rid: n for n, rid in enumerate(survivals)}
    pairs = sorted(((a, j, rid) for rid, row in survivals.items() for j, a in enumerate(row, start=1) if a > 0),
                   key=lambda p: (-p[0], p[1], order[p[2]]))
    batch = len(survivals) + other_tokens
    tau = float(len(survivals))
    best = tau * sps(batch)
    for a, j, rid in pairs:
        if j != lengths[rid] + 1:  # a_{r,j} ≤ a_{r,j−1} keeps prefixes in order; equal values by the tie rule
            raise ValueError("survivals must be non-increasing per request (a_{r,j} = Π c_{r,i}, c ≤ 1)")
        theta = (tau + a) * sps(batch + 1)
        if theta <= best:
            break  # the first non-improvement ends the search (non-anticipating)
        lengths[rid], batch, tau, best = j, batch + 1, tau + a, theta
    return lengths

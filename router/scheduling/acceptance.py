"""Acceptance estimates c_k for the scheduler, recalibrated online against verify outcomes (docs/design.md §6).

Vocabulary: for draft position k the drafter sends a signal s_k that depends on x_<k only — the DSpark
head's calibrated confidence when the drafter has one, else the peak max_v q_k(v) of the distribution
x_k was drawn from (`DraftBlock.peaks`). The estimate ĉ_k = P(x_k accepted | x_<k accepted, s_k) is
kept per (method, greedy or sampled, k, bin of s_k) as a Beta posterior with weight `prior_weight`,
centred on ρ_k · s_k: ρ_k = observed / predicted acceptances at position k over all bins, which
corrects a signal that is off everywhere (a head fitted at another temperature) after a few dozen
outcomes, while each bin learns the shape from its own outcomes. A verify
outcome labels positions 1..min(ℓ, accepted + 1): accepted up to `accepted`, rejected just after.
Counts are scaled down past `window` outcomes per bin, so the estimate follows drift (domain, load mix).

Heads are recalibrated too: Sequential Temperature Scaling is fitted offline at one temperature, and
served at another the head drifts (issue 4 measured 0.63 predicted vs 0.37 observed at T = 1).

Losslessness: the estimate for cycle n uses outcomes of cycles before n and signals of x_<k, never x_k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.types import DraftBlock

UNKNOWN = 0.5  # prior of a position without a signal (n-gram drafts)


@dataclass(slots=True)
class _Bin:
    seen: float = 0.0
    accepted: float = 0.0


@dataclass(slots=True)
class _Position:
    predicted: float = 0.0  # Σ s_k over the outcomes seen
    accepted: float = 0.0

    def ratio(self, weight: float) -> float:
        return (self.accepted + weight) / (self.predicted + weight)


@dataclass(slots=True)
class AcceptanceModel:
    bins: int = 10
    prior_weight: float = 8.0  # pseudo-outcomes behind the signal
    window: float = 2000.0  # outcomes a bin remembers before older ones fade
    ratio_weight: float = 2.0  # pseudo-outcomes behind ρ_k = 1
    _table: dict[tuple[str, bool, int, int], _Bin] = field(default_factory=dict)
    _positions: dict[tuple[str, bool, int], _Position] = field(default_factory=dict)

    @staticmethod
    def signals(block: DraftBlock) -> list[float | None]:
        """s_1..s_γ of a block: head confidences, else draft peaks, else unknown."""
        if block.confidences is not None:
            return list(block.confidences)
        if block.peaks is not None:
            return list(block.peaks)
        return [None] * len(block)

    def estimate(self, method: str, greedy: bool, signals: Sequence[float | None]) -> list[float]:
        """ĉ_1..ĉ_γ in [0, 1]."""
        out = []
        for k, s in enumerate(signals, start=1):
            pos = self._positions.get((method, greedy, k))
            rho = pos.ratio(self.ratio_weight) if pos else 1.0
            prior = min(max((UNKNOWN if s is None else s) * rho, 0.0), 1.0)
            b = self._table.get((method, greedy, k, self._bin(s)))
            seen, accepted = (b.seen, b.accepted) if b else (0.0, 0.0)
            out.append((accepted + self.prior_weight * prior) / (seen + self.prior_weight))
        return out

    def observe(self, method: str, greedy: bool, signals: Sequence[float | None], verified: int,
                accepted: int) -> None:
        """Record one verify outcome: `verified` = ℓ drafts sent, `accepted` of them accepted."""
        for k in range(1, min(verified, accepted + 1) + 1):
            b = self._table.setdefault((method, greedy, k, self._bin(signals[k - 1])), _Bin())
            if b.seen >= self.window:
                b.seen, b.accepted = b.seen / 2, b.accepted / 2
            b.seen += 1
            b.accepted += k <= accepted
            pos = self._positions.setdefault((method, greedy, k), _Position())
            if pos.predicted >= self.window:
                pos.predicted, pos.accepted = pos.predicted / 2, pos.accepted / 2
            pos.predicted += UNKNOWN if signals[k - 1] is None else signals[k - 1]
            pos.accepted += k <= accepted

    def outcomes(self, method: str, greedy: bool, k: int) -> float:
        """Outcomes recorded at position k (all bins): how much the estimates there rest on data."""
        return sum(b.seen for (m, g, pos, _), b in self._table.items() if (m, g, pos) == (method, greedy, k))

    def _bin(self, s: float | None) -> int:
        return -1 if s is None else min(int(max(s, 0.0) * self.bins), self.bins - 1)

"""The speculation cache: the drafter runs ahead (speculative speculative decoding, SSD).

While block n is verified, the drafter guesses the verifier's *outcome* — ℓ of the verified drafts
accepted, then the token v the target emits after them (recovered at a rejection, bonus after all ℓ_s
verified drafts) — and drafts, for each of the likeliest guesses, the block n + 1 that outcome would start.
The next draft request carries the tokens committed since: the outcome is read from them
(`outcome_of`); a hit answers from the cache, a miss drafts afresh.

Exactness is untouched: verification does not change, a cached block carries the q its tokens were drawn
from, and whether it is used depends only on the committed outcome of the cycle before.

Which outcomes to pre-draft (`likely_outcomes`) is one rule: the `budget` outcomes of highest estimated
probability P(ℓ) · w(v), where P(ℓ) comes from the per-position acceptance estimates a_k of the block
(P(ℓ) = a_1 ⋯ a_ℓ (1 − a_{ℓ+1}) below ℓ_s, a_1 ⋯ a_{ℓ_s} at it), and w(v) from the drafter's own
distribution at position ℓ + 1: renormalised without the rejected draft below ℓ_s (a rejected token has
no residual mass), whole at ℓ_s (the bonus). A position's fan-out therefore follows its probability mass,
the allocation the SSD paper derives (a capped geometric series over positions for geometric acceptance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.types import DraftBlock


@dataclass(frozen=True, slots=True)
class Steering:
    """Saguaro sampling (SSD): a drafter steered this way draws each draft of a request that drafts ahead from
    q' = q with its `top` likeliest tokens scaled by `factor` ∈ (0, 1), renormalised. When the draft is rejected,
    the recovered token follows norm(max(0, p − q')), which then puts its mass on those top tokens, the ones
    `likely_outcomes` pre-drafts for; the price is a little acceptance. The verifier gets q', the distribution
    the draft was drawn from, so exactness is unchanged."""

    top: int
    factor: float

    def __post_init__(self) -> None:
        if self.top < 1 or not 0.0 < self.factor <= 1.0:
            raise ValueError(f"steering needs top ≥ 1 and a factor in (0, 1], got {self.top}, {self.factor}")

    def apply(self, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """q [R, K] sorted descending (a truncated draft distribution), rows [R] bool: the rows to steer → q'."""
        scale = torch.ones_like(q)
        scale[:, : self.top] = torch.where(rows[:, None], self.factor, 1.0)
        steered = q * scale
        return steered / steered.sum(-1, keepdim=True)


@dataclass(frozen=True, slots=True)
class Outcome:
    accepted: int  # ℓ: drafts accepted
    token: int  # v: the token the target emitted after them


@dataclass(slots=True)
class Predrafted:
    """What was drafted ahead for one request after one block."""

    base: int  # committed tokens when the block was drafted (its anchor is token base − 1)
    drafts: list[int]  # the drafts sent to verification (the block cut to ℓ_s)
    blocks: dict[Outcome, DraftBlock]  # a pre-drafted next block per guessed outcome


def outcome_of(spec: Predrafted, tokens: list[int]) -> Outcome | None:
    """The outcome `tokens` (all committed tokens now) show, or None if they do not follow the block."""
    new = tokens[spec.base :]
    accepted = len(new) - 1
    if accepted < 0 or accepted > len(spec.drafts) or new[:accepted] != spec.drafts[:accepted]:
        return None
    return Outcome(accepted, new[-1])


def likely_outcomes(
    drafts: list[int],  # [ℓ_s] the verified drafts x_1..x_ℓs
    survival: list[float],  # [ℓ_s] a_k: estimated probability that x_k is accepted given x_<k were
    probs: torch.Tensor,  # [ℓ_s + 1, V] the drafter's distribution at positions 1..ℓ_s + 1
    budget: int,
    per_position: int = 8,  # candidate tokens considered at each position
) -> list[Outcome]:
    """The `budget` likeliest outcomes, best first (see the module docstring)."""
    verified = len(drafts)
    reach = 1.0  # a_1 ⋯ a_ℓ
    scored: list[tuple[float, Outcome]] = []
    for ell in range(verified + 1):
        row = probs[ell].clone()
        if ell < verified:
            rejected = 1.0 - survival[ell]
            weight = reach * rejected
            row[drafts[ell]] = 0.0  # the rejected draft is never the recovered token
            row = row / row.sum().clamp_min(1e-12)
        else:
            weight = reach
        top = row.topk(min(per_position, row.numel()))
        scored.extend((weight * float(p), Outcome(ell, int(v))) for p, v in zip(top.values, top.indices, strict=True)
                      if p > 0)
        if ell < verified:
            reach *= survival[ell]
    scored.sort(key=lambda s: -s[0])
    return [outcome for _, outcome in scored[:budget]]


@dataclass(slots=True)
class SpeculationStats:
    hits: int = 0
    misses: int = 0
    fanout: int = 0  # pre-drafted blocks, over all cycles


class PredraftCache:
    """Per request the speculation of its last block; consumed (hit or miss) by the next draft request."""

    def __init__(self) -> None:
        self._specs: dict[str, Predrafted] = {}
        self.stats = SpeculationStats()

    def store(self, request_id: str, spec: Predrafted) -> None:
        self._specs[request_id] = spec
        self.stats.fanout += len(spec.blocks)

    def add(self, request_id: str, blocks: dict[Outcome, DraftBlock]) -> None:
        """More pre-drafted blocks for the request's stored speculation (none stored: nothing)."""
        spec = self._specs.get(request_id)
        if spec is not None:
            spec.blocks.update(blocks)
            self.stats.fanout += len(blocks)

    def fanout(self, request_id: str) -> int:
        """Blocks pre-drafted so far for the request's stored speculation (0: none stored)."""
        spec = self._specs.get(request_id)
        return 0 if spec is None else len(spec.blocks)

    def take(self, request_id: str, tokens: list[int]) -> DraftBlock | None:
        """The cached block for the outcome `tokens` show (a hit), else None (a miss); the entry is gone."""
        spec = self._specs.pop(request_id, None)
        if spec is None:
            return None
        if not spec.blocks:
            return None  # nothing was drafted ahead in time: not counted
        outcome = outcome_of(spec, tokens)
        block = None if outcome is None else spec.blocks.get(outcome)
        if block is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        return block

    def drop(self, request_id: str) -> None:
        self._specs.pop(request_id, None)

    @property
    def hit_rate(self) -> float:
        total = self.stats.hits + self.stats.misses
        return self.stats.hits / total if total else 0.0

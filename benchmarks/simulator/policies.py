"""Verify-length policies and draft blocks in simulated time.

`SimBudget` is the router's `router.budget.VerifyBudget` with the clock passed in: the same state (each active
request's previous-block survivals, EMAs of a plain and a drafting cycle's time beyond the profiled step, the
probe schedule while drafting does not pay) and the same search, `router.budget.plan_budget`, reused as is.
The plan never sees the block it trims: a block's survivals are recorded only after it is trimmed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from benchmarks.simulator.model import Arm, StepProfile
from router.budget import leading, plan_budget
from services.batching import ema


@dataclass(slots=True)
class Block:
    """A drafted block: per-position true acceptance probabilities and the survivals the scheduler sees."""

    probs: list[float]  # p_1..p_n: P(draft k accepted | drafts < k accepted)
    survivals: list[float]  # a_k = Π_{i≤k} p_i (calibrated: the scheduler's estimate is the truth)


def draw_block(arm: Arm, length: int, rng: random.Random) -> Block:
    """A block of `length` drafts. Scheduled dspark draws each position's probability from Beta(mean c_k), so
    confidences vary from block to block and carry signal; the other arms use c_k itself (no signal needed)."""
    probs = []
    for k in range(1, length + 1):
        c = arm.c(k)
        if arm.policy == "dspark" and 0.0 < c < 1.0:
            c = rng.betavariate(arm.concentration * c, arm.concentration * (1.0 - c))
        probs.append(c)
    survivals, a = [], 1.0
    for p in probs:
        a *= p
        survivals.append(a)
    return Block(probs, survivals)


def accepted(block: Block, verify_len: int, rng: random.Random) -> int:
    """Leading drafts of the first `verify_len` that the verifier accepts (position k given k − 1 accepted)."""
    for k in range(verify_len):
        if rng.random() >= block.probs[k]:
            return k
    return verify_len


@dataclass(slots=True)
class SimPlan:
    budget: int  # K*
    threshold: float  # λ(K*)
    batch_tokens: int  # planned B
    planned_at: float  # simulated seconds
    draft: bool = True  # False: K* = 0, decode plainly


@dataclass(slots=True)
class SimBudget:
    """One verifier's streaming scheduler (see module docstring); times are simulated seconds."""

    profile: StepProfile
    fallback_threshold: float = 0.3
    probe_s: tuple[float, float] = (0.5, 8.0)
    alpha: float = 0.2  # weight of the newest sample in the EMAs
    rows: dict[int, tuple[float, ...]] = field(default_factory=dict)  # request → previous block's survivals
    step_s: float = 0.0  # EMA of the verify round trip: how long a plan stays current
    plain_extra_s: float = 0.0  # EMA: a plain cycle beyond the profiled step
    draft_extra_s: float = 0.0  # EMA: a drafting cycle beyond the profiled step
    plan: SimPlan | None = None
    plans: int = 0
    budget_sum: int = 0
    _probe_every: float = 0.0
    _probe_at: float = 0.0

    def join(self, rid: int) -> None:
        self.rows.setdefault(rid, ())

    def leave(self, rid: int) -> None:
        self.rows.pop(rid, None)

    def observe_verify(self, seconds: float) -> None:
        self.step_s = ema(self.step_s, seconds, self.alpha)

    def observe_cycle(self, seconds: float, drafted: bool) -> None:
        if self.plan is None:
            return
        extra = max(0.0, seconds - self.profile.step_s(self.plan.batch_tokens))
        if drafted:
            self.draft_extra_s = ema(self.draft_extra_s, extra, self.alpha)
        else:
            self.plain_extra_s = ema(self.plain_extra_s, extra, self.alpha)

    def current(self, now: float) -> SimPlan:
        if self.plan is None or now - self.plan.planned_at >= self.step_s:
            self.plan = self._replan(now)
        return self.plan

    def wants_draft(self, now: float) -> bool:
        """Draft when the plan says drafting pays, or when a probe is due (growing intervals)."""
        if self.current(now).draft:
            self._probe_every = self.probe_s[0]
            return True
        if now < self._probe_at:
            return False
        self._probe_every = self._probe_every or self.probe_s[0]
        self._probe_at = now + self._probe_every
        self._probe_every = min(2 * self._probe_every, self.probe_s[1])
        return True

    def trim(self, rid: int, survivals: list[float], now: float) -> int:
        """ℓ for a block just drafted, then record its survivals for later plans (never for this one)."""
        length = leading(survivals, self.current(now).threshold)
        self.rows[rid] = tuple(survivals)
        return length

    def _replan(self, now: float) -> SimPlan:
        anchors = max(len(self.rows), 1)
        self.plans += 1
        if not any(self.rows.values()):  # no block seen yet: the router's threshold policy
            pool = [a for row in self.rows.values() for a in row if a >= self.fallback_threshold]
            return SimPlan(len(pool), self.fallback_threshold, anchors + len(pool), now)
        k, lam = plan_budget(self.rows.values(), anchors, self.profile.sps,
                             draft_s=max(0.0, self.draft_extra_s - self.plain_extra_s), extra_s=self.plain_extra_s)
        self.budget_sum += k
        return SimPlan(k, lam, anchors + k, now, draft=k > 0)


def verify_len(arm: Arm, bound: int, block: Block | None, budget: SimBudget | None, rid: int, now: float) -> int:
    """ℓ of a cycle under the arm's policy; `bound` already caps γ by the tokens still to emit."""
    if block is None or bound <= 0:
        return 0
    if arm.policy == "dspark" and budget is not None:
        return min(budget.trim(rid, block.survivals, now), bound)
    return bound


def expected_tau(arm: Arm, length: int) -> float:
    """1 + Σ_k a_k for a fixed block of `length` (closed form for tests and checks)."""
    total, a = 1.0, 1.0
    for k in range(1, length + 1):
        a *= arm.c(k)
        total += a
    return total if math.isfinite(total) else 1.0

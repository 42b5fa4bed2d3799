"""Verify-length policies and draft blocks in simulated time.

`SimBudget` is the router's `router.scheduling.budget.VerifyBudget` itself on simulated time: the same state
(each active request's previous-block survivals, EMAs of a plain and a drafting cycle's time beyond the profiled
step, the probe schedule while drafting does not pay) and the same search,
`router.scheduling.budget.plan_budget`. The plan never sees the block it trims: a block's survivals are recorded
only after it is trimmed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from benchmarks.simulator.model import Arm, StepProfile
from router.scheduling.budget import Plan, VerifierView, VerifyBudget

OWN_LOAD = VerifierView()  # the simulated router sees no other router's requests


@dataclass(slots=True)
class Block:
    """A drafted block: per-position true acceptance probabilities and the survivals the scheduler sees."""

    probs: list[float]  # p_1..p_n: P(draft k accepted | drafts < k accepted)
    survivals: list[float]  # a_k = Π_{i≤k} p_i (calibrated: the scheduler's estimate is the truth)


def draw_block(arm: Arm, length: int, rng: random.Random, quality: float = 1.0) -> Block:
    """A block of `length` drafts. Scheduled dspark draws each position's probability from Beta(mean c_k), so
    confidences vary from block to block and carry signal; the other arms use c_k itself (no signal needed).
    `quality` scales c_k (a block drafted ahead from stand-in features)."""
    probs = []
    for k in range(1, length + 1):
        c = arm.c(k) * quality
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


class SimBudget(VerifyBudget):
    """The router's `VerifyBudget` on simulated time (no board: a verifier's load is its own requests), counting
    its plans for the report."""

    def __init__(self, profile: StepProfile, fallback_threshold: float = 0.3,
                 probe_s: tuple[float, float] = (0.5, 8.0)):
        super().__init__(profile.sps, fallback_threshold, probe_s=probe_s)
        self.plans = self.budget_sum = 0

    def _replan(self, view: VerifierView, now: float) -> Plan:
        plan = super()._replan(view, now)
        self.plans += 1
        self.budget_sum += plan.budget
        return plan


def verify_len(arm: Arm, bound: int, block: Block | None, budget: SimBudget | None, rid: int, now: float) -> int:
    """ℓ of a cycle under the arm's policy; `bound` already caps γ by the tokens still to emit."""
    if block is None or bound <= 0:
        return 0
    if arm.policy == "dspark" and budget is not None:
        return min(budget.trim(rid, block.survivals, OWN_LOAD, now=now)[0], bound)
    return bound


def expected_tau(arm: Arm, length: int) -> float:
    """1 + Σ_k a_k for a fixed block of `length` (closed form for tests and checks)."""
    total, a = 1.0, 1.0
    for k in range(1, length + 1):
        a *= arm.c(k)
        total += a
    return total if math.isfinite(total) else 1.0

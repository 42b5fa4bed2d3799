"""Scheduler + acceptance rule keep the target's distribution when c_{k+1} depends on x_k.

A two-position toy: the drafter's confidence in its second draft depends on its first draft, as the
DSpark head's does through the Markov embedding. Algorithm 1 (early stop) may let x_1 decide whether x_2
is verified, never whether x_1 itself is; the emitted pair (y_1, y_2) then follows p_1(y_1)·p_2(y_2|y_1).
The negative control picks the best prefix in hindsight: x_1's own value then decides its admission
through c_2(x_1), and the test must catch the bias.
"""

from __future__ import annotations

import numpy as np
import torch

from router.scheduling.algorithm1 import schedule
from router.scheduling.budget import VerifierView, VerifyBudget, leading, plan_budget
from router.scheduling.sps import survival
from services.sampling import accept_stochastic
from tests.chi2 import chisquare

P1 = np.array([0.5, 0.3, 0.2])
P2 = np.array([[0.6, 0.2, 0.2], [0.1, 0.7, 0.2], [0.3, 0.3, 0.4]])  # p_2(· | y_1)
Q1 = np.array([0.7, 0.2, 0.1])
Q2 = np.array([[0.5, 0.3, 0.2], [0.2, 0.6, 0.2], [0.2, 0.2, 0.6]])  # q_2(· | x_1)
C1, C2 = 0.7, np.array([0.9, 0.1, 0.5])  # c_2 depends on x_1
UNIMODAL = {1: 1.0, 2: 0.8, 3: 0.6}.__getitem__  # SPS(B): Θ rises then falls along the greedy path
JAGGED = {1: 1.0, 2: 0.55, 3: 0.5}.__getitem__  # Θ dips at B = 2 and recovers at B = 3


def retrospective(survivals, sps):
    """The biased variant: the best prefix of the greedy path, chosen after looking at all of it."""
    (rid, row), = survivals.items()
    thetas = [(1 + sum(row[:n])) * sps(1 + n) for n in range(len(row) + 1)]
    return {rid: int(np.argmax(thetas))}


def emitted_pairs(scheduler, sps, trials: int = 8000, seed: int = 0) -> np.ndarray:
    """Counts [3, 3] of the first two emitted tokens over independent cycles."""
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    counts = np.zeros((3, 3), dtype=int)
    for _ in range(trials):
        x1 = int(rng.choice(3, p=Q1))
        x2 = int(rng.choice(3, p=Q2[x1]))
        drafts = [x1, x2]
        length = scheduler({"r": survival([C1, C2[x1]])}, sps)["r"]
        p = torch.tensor(np.stack([P1, P2[x1], np.full(3, 1 / 3)])[: length + 1], dtype=torch.float32)
        q = torch.tensor(np.stack([Q1, Q2[x1]])[:length], dtype=torch.float32)
        accepted, token, _ = accept_stochastic(p, drafts[:length], q, gen)
        emitted = [*drafts[:accepted], token]
        if len(emitted) < 2:
            emitted.append(int(rng.choice(3, p=P2[emitted[0]])))  # the next cycle, plain decoding
        counts[emitted[0], emitted[1]] += 1
    return counts


def p_value(counts: np.ndarray) -> float:
    expected = (P1[:, None] * P2).ravel() * counts.sum()
    return chisquare(counts.ravel(), expected).pvalue


def test_algorithm_1_is_lossless_when_confidence_depends_on_the_previous_draft():
    counts = emitted_pairs(schedule, UNIMODAL)
    assert p_value(counts) > 1e-3
    assert p_value(emitted_pairs(schedule, JAGGED, seed=1)) > 1e-3


def test_negative_control_choosing_the_prefix_in_hindsight_is_caught():
    # Along this jagged curve Algorithm 1 stops at ℓ = 0, while hindsight verifies x_1 exactly when
    # c_2(x_1) is high: P(y_1 = 0) becomes 0.6 instead of 0.5.
    assert p_value(emitted_pairs(retrospective, JAGGED, seed=2)) < 1e-6


def streaming(sps, sees_own_block: bool = False):
    """The streaming form across cycles: λ(K) planned from the previous cycle's block, applied to this one.

    `sees_own_block` is the negative control: the plan is made after the block it trims arrived.
    """
    budget = VerifyBudget(sps)

    def run(survivals, _sps):
        (rid, row), = survivals.items()
        if sees_own_block:
            _, lam = plan_budget([row], 1, sps)
            return {rid: leading(row, lam)}
        return {rid: budget.trim(rid, row, VerifierView())[0]}
    return run


def test_streaming_budget_is_lossless_and_its_own_block_control_is_caught():
    assert p_value(emitted_pairs(streaming(JAGGED), JAGGED, seed=3)) > 1e-3
    assert p_value(emitted_pairs(streaming(UNIMODAL), UNIMODAL, seed=4)) > 1e-3
    assert p_value(emitted_pairs(streaming(JAGGED, sees_own_block=True), JAGGED, seed=5)) < 1e-6


def test_the_toy_exercises_x1_dependent_lengths():
    lengths = {x1: schedule({"r": survival([C1, C2[x1]])}, UNIMODAL)["r"] for x1 in range(3)}
    assert lengths == {0: 2, 1: 1, 2: 1}  # x_1 is always verified; x_2 only after a confident x_1
    hindsight = {x1: retrospective({"r": survival([C1, C2[x1]])}, JAGGED)["r"] for x1 in range(3)}
    assert hindsight == {0: 2, 1: 0, 2: 2}
    # Streaming: λ comes from the previous block (0.63, +inf or 0.35 after x_1 = 0, 1, 2 there).
    lams = [plan_budget([survival([C1, C2[x]])], 1, JAGGED)[1] for x in range(3)]
    assert lams == [C1 * C2[0], float("inf"), C1 * C2[2]]

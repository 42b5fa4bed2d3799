"""Algorithm 1: hand cases, equality with a brute-force search along the greedy path, load response."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.scheduling.algorithm1 import schedule
from router.scheduling.sps import SpsCurve, survival


def linear_sps(fixed_ms: float = 20.0, per_token_ms: float = 0.5):
    """A smooth synthetic verifier: a fixed cost per step plus a cost per batch token."""
    return lambda b: 1000.0 / (fixed_ms + per_token_ms * b)


def theta(survivals, lengths, sps, other=0) -> float:
    tau = sum(1 + sum(survivals[r][:lengths[r]]) for r in survivals)
    return tau * sps(len(survivals) + other + sum(lengths.values()))


def test_hand_cases():
    sps = linear_sps()
    # Cheap extra tokens: every likely draft is worth verifying, the unlikely tail is not.
    assert schedule({"a": [0.9, 0.8, 0.01]}, sps) == {"a": 2}
    # A request whose first draft is hopeless gets ℓ = 0 (plain decoding) while the other drafts.
    assert schedule({"a": [0.9, 0.85], "b": [0.001, 0.0005]}, sps) == {"a": 2, "b": 0}
    # Ties go to the smaller position first.
    assert schedule({"a": [0.5, 0.5]}, lambda b: 1.0) == {"a": 2}
    # An expensive verifier (step time dominated by tokens) verifies nothing.
    assert schedule({"a": [0.3, 0.1]}, linear_sps(1.0, 10.0)) == {"a": 0}
    assert survival([0.5, 0.5, 0.8]) == [0.5, 0.25, 0.2]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=5), min_size=1, max_size=4),
       st.floats(5.0, 50.0), st.floats(0.05, 4.0))
def test_equals_brute_force_along_the_greedy_path(confidences, fixed_ms, per_token_ms):
    sps = linear_sps(fixed_ms, per_token_ms)
    survivals = {f"r{i}": survival(c) for i, c in enumerate(confidences)}
    got = schedule(survivals, sps)
    # Every prefix of the greedy order (descending a, ties by position) is a candidate allocation.
    pairs = sorted(((a, j, r) for r, row in survivals.items() for j, a in enumerate(row, 1) if a > 0),
                   key=lambda p: (-p[0], p[1], int(p[2][1:])))
    best_theta = theta(survivals, dict.fromkeys(survivals, 0), sps)
    lengths = dict.fromkeys(survivals, 0)
    for _, j, r in pairs:
        lengths[r] = j
        value = theta(survivals, lengths, sps)
        best_theta = max(best_theta, value)
    assert theta(survivals, got, sps) == pytest.approx(best_theta, rel=1e-9)
    # And the best allocation over every ℓ vector is no better (greedy by a is optimal per B).
    grid = itertools.product(*(range(len(row) + 1) for row in survivals.values()))
    optimum = max(theta(survivals, dict(zip(survivals, ls, strict=True)), sps) for ls in grid)
    assert theta(survivals, got, sps) == pytest.approx(optimum, rel=1e-9)


def test_the_verify_budget_shrinks_as_load_grows():
    sps = SpsCurve((1, 8, 32, 128, 512), (20.0, 21.0, 26.0, 60.0, 200.0))  # flat, then token-bound
    row = survival([0.8, 0.8, 0.7, 0.7, 0.6, 0.6, 0.5])
    per_request = []
    for r in (1, 4, 16, 64, 128):
        lengths = schedule({f"r{i}": row for i in range(r)}, sps)
        per_request.append(sum(lengths.values()) / r)
    assert per_request == sorted(per_request, reverse=True) and per_request[0] > per_request[-1]
    assert per_request[0] == 7 and per_request[-1] < 2


def test_sps_curve_interpolates_and_extrapolates():
    curve = SpsCurve((1, 9), (10.0, 20.0))
    assert curve(1) == pytest.approx(100.0) and curve(5) == pytest.approx(1000 / 15)
    assert curve(17) == pytest.approx(1000 / 30)  # the last slope continues past the table
    with pytest.raises(ValueError):
        SpsCurve((4, 2), (1.0, 2.0))

"""The streaming scheduler: budget K and λ(K), its optimality, its response to load, when it replans."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from router.scheduling.budget import VerifierView, VerifyBudget, leading, plan_budget, sla_len
from router.scheduling.planner import VerifyPlanner
from router.scheduling.sps import SpsCurve, survival

MEASURED = SpsCurve((1, 2, 4, 8, 16, 32, 64, 128), (18.5, 25.4, 27.2, 31.1, 38.7, 56.1, 85.6, 139.9))  # this CPU
ROW = survival([0.8, 0.8, 0.7, 0.7, 0.6, 0.6, 0.5])


def best_over_all_lengths(rows, sps, other_requests=0, other_tokens=0) -> float:
    """max Θ over every vector of per-request prefix lengths (brute force)."""
    best = 0.0
    for lengths in itertools.product(*[range(len(r) + 1) for r in rows]):
        tau = len(rows) + other_requests + sum(sum(r[:n]) for r, n in zip(rows, lengths, strict=True))
        best = max(best, tau * sps(len(rows) + other_requests + other_tokens + sum(lengths)))
    return best


confidences = st.lists(st.floats(0.05, 1.0), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(st.lists(confidences, min_size=1, max_size=3), st.integers(0, 3), st.integers(0, 6))
def test_plan_reaches_the_best_theta_of_any_prefix_lengths(conf, other_requests, other_tokens):
    rows = [survival(c) for c in conf]
    k, lam = plan_budget(rows, len(rows), MEASURED, other_requests, other_tokens)
    lengths = [leading(r, lam) for r in rows]
    tau = len(rows) + other_requests + sum(sum(r[:n]) for r, n in zip(rows, lengths, strict=True))
    theta = tau * MEASURED(len(rows) + other_requests + other_tokens + sum(lengths))
    best = best_over_all_lengths(rows, MEASURED, other_requests, other_tokens)
    assert sum(lengths) >= k  # ties at λ may admit a few more
    if sum(lengths) == k:
        assert math.isclose(theta, best, rel_tol=1e-9)


def test_hand_cases():
    cheap = SpsCurve((1, 100), (20.0, 20.0 + 99 * 0.5))  # 20 ms a step + 0.5 ms a token
    k, lam = plan_budget([[0.9, 0.8, 0.01]], 1, cheap)
    assert (k, lam) == (2, 0.8)  # the unlikely tail is not worth its tokens
    assert plan_budget([], 1, cheap) == (0, math.inf)  # nothing drafted: plain decoding
    assert leading([0.9, 0.5, 0.4], 0.5) == 2 and leading([0.9], math.inf) == 0


def test_budget_per_request_shrinks_as_load_grows():
    per_request, lams = [], []
    for r in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        k, lam = plan_budget([ROW] * r, r, MEASURED)
        per_request.append(k / r)
        lams.append(lam)
    assert per_request == sorted(per_request, reverse=True) and per_request[0] >= 5 and per_request[-1] == 0
    assert lams == sorted(lams)
    # Other routers' requests on the same verifier shrink this router's budget too.
    alone, crowded = (plan_budget([ROW] * 4, 4, MEASURED, other_requests=n, other_tokens=n)[0] for n in (0, 120))
    assert crowded < alone


def test_trim_uses_a_plan_made_before_the_block_arrived():
    budget = VerifyBudget(MEASURED)
    budget.join("a")
    budget.join("b")
    first, plan = budget.trim("a", ROW, VerifierView())
    assert (first, plan.threshold) == (4, 0.3)  # no earlier block: the threshold policy
    second, plan = budget.trim("b", ROW, VerifierView())  # step_s = 0: replanned, from a's block only
    assert plan.budget > 0 and second == leading(ROW, plan.threshold)
    budget.step_s = 10.0  # one verifier step lasts long: the plan stays in force
    # A block that arrives in the same step is trimmed by the same λ whatever its own survivals are.
    for row in (survival([0.99] * 7), survival([0.3] * 7)):
        length, same = budget.trim("a", row, VerifierView())
        assert same is plan and length == leading(row, plan.threshold)
    budget.step_s = 0.0
    assert budget.current(VerifierView()) is not plan  # replanned once the step is over


def test_without_a_profile_the_budget_is_the_threshold_policy():
    budget = VerifyBudget(None, fallback_threshold=0.5)
    length, plan = budget.trim("a", ROW, VerifierView())
    assert plan.threshold == 0.5 and length == leading(ROW, 0.5) == 2


def test_sla_len_adds_drafts_until_the_expected_tokens_reach_the_need():
    row = [0.9, 0.72, 0.2]
    assert [sla_len(row, need) for need in (0.5, 1.0, 1.5, 2.5, 2.7, 9.0)] == [0, 0, 1, 2, 3, 3]


def test_drafting_cost_can_make_plain_decoding_the_plan_and_probes_keep_it_current():
    row = survival([0.6, 0.5, 0.4])
    assert plan_budget([row], 1, MEASURED)[0] > 0  # drafting free: verify some
    assert plan_budget([row], 1, MEASURED, draft_s=0.030)[0] == 0  # a 30 ms draft does not pay for τ ≈ 1.8
    budget = VerifyBudget(MEASURED, probe_s=(1.0, 4.0))
    budget.trim("a", row, VerifierView())  # a first block to plan from
    budget.observe_cycle(1 / MEASURED(budget.plan.batch_tokens) + 0.030, drafted=True)  # drafting adds 30 ms
    budget.step_s, budget.plan = 0.0, None  # replan on every call (on the test's clock)
    asks = [budget.wants_draft(VerifierView(), now=t) for t in (100.0, 100.5, 101.0, 102.0, 103.0, 105.0)]
    assert asks == [True, False, True, False, True, False]  # probes at growing intervals: 1 s, 2 s, then 4 s
    budget.draft_extra_s = 0.0  # drafting got cheap: the plan drafts again, probing starts over
    assert budget.wants_draft(VerifierView(), now=106.0) and budget._probe_every == 1.0


def test_cache_hits_take_drafting_off_the_critical_path_and_the_plan_drafts_again():
    row = survival([0.6, 0.5, 0.4])
    budget = VerifyBudget(MEASURED)
    budget.trim("a", row, VerifierView())
    step = 1 / MEASURED(budget.plan.batch_tokens)
    for _ in range(20):  # drafted on the critical path: 30 ms a cycle, more than τ ≈ 1.8 pays for
        budget.observe_cycle(step + 0.030, drafted=True)
    budget.step_s, budget.plan = 0.0, None
    assert budget.hit_rate == 0.0 and not budget.current(VerifierView()).draft
    for _ in range(20):  # answered from the speculation cache: 1 ms a cycle
        budget.observe_cycle(step + 0.001, drafted=True, hit=True)
    assert budget.hit_rate > 0.95 and budget.draft_extra_s > 0.029  # the miss cost is remembered, not mixed in
    budget.plan = None
    assert budget.drafting_s < 0.003 and budget.current(VerifierView()).draft
    for _ in range(5):  # the hits stop (a busy drafter): the expected cost climbs back towards the miss cost
        budget.observe_cycle(step + 0.030, drafted=True)
    assert 0.010 < budget.drafting_s < 0.030


def test_each_verifier_replica_has_its_own_budget_and_a_moved_request_follows():
    where = {"a": "v1", "b": "v1", "c": "v2"}
    planner = VerifyPlanner(0.3, engine_of=where.get)
    for rid in where:
        planner.join(rid)
    assert sorted(planner.budget("a")[1].rows) == ["a", "b"]
    assert list(planner.budget("c")[1].rows) == ["c"]
    where["b"] = "v2"  # re-prefilled on the other replica
    planner.budget("b")
    assert sorted(planner.budget("c")[1].rows) == ["b", "c"] and list(planner.budget("a")[1].rows) == ["a"]
    del where["b"]  # unplaced for a moment (its replica failed): still counted where it was
    assert planner.budget("b")[0] == "v2"
    planner.leave("b")
    assert list(planner.budget("c")[1].rows) == ["c"]


def test_a_probe_verifies_its_whole_block_so_its_outcomes_teach_the_estimates():
    row = survival([0.6, 0.5, 0.4])
    budget = VerifyBudget(MEASURED, probe_s=(1.0, 4.0))
    budget.trim("a", row, VerifierView())
    budget.observe_cycle(1 / MEASURED(budget.plan.batch_tokens) + 0.030, drafted=True)  # drafting adds 30 ms
    budget.step_s, budget.plan = 0.0, None
    assert budget.wants_draft(VerifierView(), now=100.0)  # the first probe
    length, plan = budget.trim("a", row, VerifierView(), now=100.0)
    assert not plan.draft and length == len(row)  # not cut to nothing by λ = +inf


def test_a_request_admitted_alone_is_planned_from_the_last_block_seen():
    row = survival([0.6, 0.5, 0.4])
    budget = VerifyBudget(MEASURED)
    budget.trim("a", row, VerifierView())
    budget.observe_cycle(1 / MEASURED(budget.plan.batch_tokens) + 0.030, drafted=True)  # drafting adds 30 ms
    budget.leave("a")
    budget.join("b")  # alone, with no block of its own yet
    budget.step_s, budget.plan = 0.0, None
    assert not budget.current(VerifierView()).draft  # not the threshold policy's "draft on faith"
    assert VerifyBudget(MEASURED).current(VerifierView()).draft  # nothing seen at all: it does draft

"""The cluster simulator (`benchmarks/simulator`): closed forms, policies, scaling, determinism, calibration."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from benchmarks.simulator import Arm, Cluster, CostModel, DraftCost, Simulation, SimWorkload, StepProfile, simulate
from benchmarks.simulator.calibrate import calibrate
from benchmarks.simulator.policies import OWN_LOAD, SimBudget
from benchmarks.simulator.studies import validate
from router.scheduling.sps import SpsCurve

STEP_S = 0.010


def flat_cost(draft_s: float = 0.0, **kw) -> CostModel:
    """Constant 10 ms steps, free network and router, no batch window: cycles are exactly one step."""
    profile = StepProfile(SpsCurve((1, 10_000), (STEP_S * 1000, STEP_S * 1000)))
    return CostModel(profile, {"default": DraftCost(draft_s)}, **{"hop_s": 0.0, "router_s": 0.0, "batch_window_s": 0.0,
                                                                   **kw})


def fixed(accept: float, gamma: int = 3) -> Arm:
    return Arm("fixed", "fixed", "default", gamma, (accept,) * gamma)


def test_full_acceptance_matches_closed_form():
    gamma, cycles = 3, 4
    output = 1 + cycles * (gamma + 1)  # the prefill's token, then γ + 1 per cycle
    r = simulate(fixed(1.0, gamma), flat_cost(), Cluster(1, 1), SimWorkload(8, output, clients=1, requests=1))
    assert r.tau == gamma + 1
    assert r.mean_verify_len == gamma
    assert r.output_throughput == pytest.approx(output / ((1 + cycles) * STEP_S))
    assert r.per_user_tok_s_median == pytest.approx((output - 1) / (cycles * STEP_S))
    assert r.ttft_ms_mean == pytest.approx(STEP_S * 1000)


def test_zero_acceptance_emits_one_token_per_cycle():
    r = simulate(fixed(0.0), flat_cost(), Cluster(1, 1), SimWorkload(8, 20, clients=1, requests=3))
    assert r.tau == 1.0
    assert r.per_user_tok_s_median == pytest.approx(1 / STEP_S)


def test_none_never_drafts():
    sim = Simulation(Arm("none", "none"), flat_cost(0.005), Cluster(1, 1), SimWorkload(8, 20, clients=4, requests=8))
    r = sim.run()
    assert r.draft_fraction == 0.0 and r.mean_verify_len == 0.0 and r.tau == 1.0
    assert not sim.drafters[0].sessions


def test_dspark_decodes_plainly_when_drafting_does_not_pay():
    arm = Arm("dspark", "dspark", "default", 4, (0.6,) * 4)
    r = simulate(arm, flat_cost(draft_s=0.5), Cluster(1, 1), SimWorkload(8, 64, clients=2, requests=4))
    assert r.mean_budget == 0.0  # K* = 0 in every plan once the cost is measured
    assert r.draft_fraction < 0.15  # only the first blocks and the probes draft
    def budget(draft_extra_s: float) -> SimBudget:
        b = SimBudget(flat_cost().profile)
        b.rows, b.plain_extra_s, b.draft_extra_s = {1: (0.6, 0.36)}, 0.001, draft_extra_s
        return b

    assert not budget(0.5).current(OWN_LOAD, 0.0).draft
    assert budget(0.001).current(OWN_LOAD, 0.0).budget == 2


def test_throughput_scales_with_verifiers_under_proportional_load():
    arm, cost = fixed(0.7), flat_cost(0.002)
    one = simulate(arm, cost, Cluster(1, 1), SimWorkload(8, 32, clients=8, requests=24))
    four = simulate(arm, cost, Cluster(4, 4), SimWorkload(8, 32, clients=32, requests=96))
    assert four.output_throughput / one.output_throughput == pytest.approx(4.0, rel=0.1)
    assert four.per_user_tok_s_median == pytest.approx(one.per_user_tok_s_median, rel=0.1)


def test_deterministic_with_a_seed():
    arm = Arm("dspark", "dspark", "default", 5, (0.7, 0.6, 0.5))
    work, cost = SimWorkload(16, 40, clients=6, requests=18, stagger_s=0.05), flat_cost(0.003)
    runs = [dataclasses.replace(simulate(arm, cost, Cluster(2, 1), work, seed=7), wall_s=0.0) for _ in range(2)]
    assert runs[0] == runs[1]
    other = dataclasses.replace(simulate(arm, cost, Cluster(2, 1), work, seed=8), wall_s=0.0)
    assert other != runs[0]


def test_a_cache_hit_takes_the_draft_off_the_critical_path():
    gamma, cycles = 3, 5
    output = 1 + cycles * (gamma + 1)
    work = SimWorkload(8, output, clients=1, requests=1)
    cached = dataclasses.replace(fixed(1.0, gamma), ahead_hit=1.0, ahead_budget=1)
    r = simulate(cached, flat_cost(draft_s=0.005), Cluster(1, 1), work)
    # the first block is drafted afresh (5 ms); each later one was drafted during the 10 ms verify before it
    assert r.per_user_tok_s_median == pytest.approx((output - 1) / (cycles * STEP_S + 0.005))
    assert r.extra == {"cache_hits": cycles - 1, "cache_hit_rate": (cycles - 1) / cycles}
    plain = simulate(fixed(1.0, gamma), flat_cost(draft_s=0.005), Cluster(1, 1), work)
    assert plain.per_user_tok_s_median == pytest.approx((output - 1) / (cycles * (STEP_S + 0.005)))
    assert plain.extra == {}


def test_pre_drafting_that_outlasts_the_verify_never_hits_and_delays_a_draft_by_one_step_at_most():
    work = SimWorkload(8, 21, clients=1, requests=1)
    slow = dataclasses.replace(fixed(1.0), ahead_hit=1.0, ahead_budget=3)  # 3 × 5 ms > the 10 ms verify
    r = simulate(slow, flat_cost(draft_s=0.005), Cluster(1, 1), work)
    base = simulate(fixed(1.0), flat_cost(draft_s=0.005), Cluster(1, 1), work)
    assert r.extra["cache_hits"] == 0
    cycles = 5  # a real draft waits for the pre-drafting step in progress (5 ms), then ends the job
    assert 20 / (20 / base.per_user_tok_s_median + cycles * 0.005) <= r.per_user_tok_s_median
    assert r.per_user_tok_s_median < base.per_user_tok_s_median


def test_the_scheduler_drafts_again_when_the_cache_answers():
    arm = Arm("dspark", "dspark", "default", 4, (0.6,) * 4)
    work = SimWorkload(8, 200, clients=1, requests=2)
    without = simulate(arm, flat_cost(draft_s=0.009), Cluster(1, 1), work)  # a 9 ms draft does not pay
    cached = simulate(dataclasses.replace(arm, ahead_hit=0.9, ahead_budget=1), flat_cost(draft_s=0.009),
                      Cluster(1, 1), work)
    assert without.draft_fraction < 0.3 < cached.draft_fraction
    assert cached.per_user_tok_s_median > without.per_user_tok_s_median


def _cell(arm: str, c: int, tpot_ms: float, tau: float, verify_len: float, uncond: list[float]) -> dict:
    completed, output = 8, 32
    cycles = (output - 1) * completed / tau
    return {"arm": arm, "load": {"mode": "closed", "concurrency": c},
            "summary": {"completed": completed, "total_input_tokens": 60 * completed,
                        "total_output_tokens": output * completed, "output_throughput": 1000 / tpot_ms,
                        "per_user_tok_s_median": 1000 / tpot_ms, "tpot_ms_mean": tpot_ms, "ttft_ms_mean": 70.0},
            "server": {"drafts": cycles if uncond else 0, "per_position_unconditional": uncond,
                       "verify_cycles": cycles, "mean_verify_len": verify_len}}


def fixture_results() -> dict:
    return {"metadata": {"gamma": 4}, "cells": [
        _cell("none", 1, 22.0, 1.0, 0.0, []), _cell("mtp1", 1, 21.0, 1.8, 1.0, [0.8]),
        _cell("dspark-fixed", 1, 26.0, 2.1, 3.7, [0.55, 0.25, 0.19, 0.15]),
        _cell("dspark", 1, 24.0, 1.05, 0.05, [0.9]), _cell("dspark-ahead", 1, 20.0, 1.05, 0.05, [0.9])]}


# The fixture's step profile (ms at 1, 8 and 64 batch tokens): its own, so that regenerating the committed
# benchmarks/results/sps-cpu.json on a faster engine does not change what the fixture's cells mean.
FIXTURE_PROFILE = StepProfile(SpsCurve((1, 8, 64), (12.0, 14.0, 30.0)))


def _check_calibration(results: dict, profile: StepProfile = FIXTURE_PROFILE) -> None:
    cal = calibrate(results, profile)
    assert cal.hop_s > 0 and cal.router_s > 0 and math.isfinite(cal.ttft_offset_s)
    assert cal.draft_s and all(0 < s < 1 and math.isfinite(s) for s in cal.draft_s.values())
    assert cal.arms["dspark"].accept == cal.arms["dspark-fixed"].accept  # same drafter, untrimmed blocks
    assert cal.arms["dspark-ahead"].accept == cal.arms["dspark-fixed"].accept
    assert all(0 < c <= 1 for c in cal.arms["dspark-fixed"].accept)
    rows = validate(results, cal, cal.cost(profile), seeds=1)
    assert rows and all(r.simulated["output_throughput"] > 0 for r in rows)


def test_calibration_on_a_fixture_gives_finite_positive_constants():
    _check_calibration(fixture_results())


def test_gpu_example_profile_is_marked_illustrative():
    path = Path("benchmarks/simulator/profiles/gpu-example.json")
    assert "ILLUSTRATIVE" in json.loads(path.read_text())["description"]
    profile = StepProfile.load(path)
    assert profile.step_s(64) == pytest.approx(0.025) and profile.step_s(512) == pytest.approx(0.050)


def test_plain_runs_hide_the_round_trip_and_a_dspark_request_that_does_not_draft_joins_them():
    """With a 5 ms round trip per exchange, a plain run replying every 4 steps decodes at nearly one step a token;
    one exchange a token costs step + round trip. dspark with drafting too dear hands off to the same runs."""
    work = SimWorkload(8, 65, clients=1, requests=3)
    slow_hop = dict(hop_s=0.0025)
    exchange = simulate(Arm("none", "none"), flat_cost(**slow_hop), Cluster(1, 1), work)
    runs = simulate(Arm("none", "none"), flat_cost(plain_run=4, **slow_hop), Cluster(1, 1), work)
    assert exchange.per_user_tok_s_median == pytest.approx(1 / (STEP_S + 0.005), rel=0.02)
    assert runs.per_user_tok_s_median > 0.9 / STEP_S and runs.tau == pytest.approx(4.0, rel=0.1)
    arm = Arm("dspark", "dspark", "default", 4, (0.6,) * 4)
    handed = simulate(arm, flat_cost(draft_s=0.05, plain_run=4, **slow_hop), Cluster(1, 1), work)
    assert handed.requests == runs.requests and handed.draft_fraction < 0.2  # the first block, then runs
    assert handed.per_user_tok_s_median > 0.8 * runs.per_user_tok_s_median


def test_calibration_reads_plain_runs_from_a_none_cell_with_several_tokens_a_reply():
    results = fixture_results()
    plain = results["cells"][0]
    plain["summary"]["tpot_ms_mean"] = 8.0  # one served step: the profiled one (12 ms) is 1.5 × slower
    plain["server"]["verify_cycles"] /= 4  # four tokens a reply
    cal = calibrate(results, FIXTURE_PROFILE)
    assert cal.plain_run == 4 and cal.step_speed == pytest.approx(1.5)
    assert cal.cost(FIXTURE_PROFILE).profile.step_s(1) == pytest.approx(0.008) and cal.router_s > 0

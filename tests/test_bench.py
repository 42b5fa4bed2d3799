"""`dspark bench` end to end against the real API over gRPC tiers, and its losslessness gates."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from benchmarks.serve_bench.plots import plots
from benchmarks.serve_bench.report import markdown
from benchmarks.serve_bench.runner import BenchConfig, greedy_gate, permutation_chi2, run
from benchmarks.serve_bench.workloads import load_workload
from cluster.launcher import start_tiers, stop_tiers
from router.settings import RouterSettings
from tests.tiers import api_server, drafter_settings, verifier_settings

pytestmark = pytest.mark.slow
ARMS = ["none", "mtp1", "dspark-fixed", "dspark"]


@pytest.fixture(scope="module")
def base_url():
    tiers = start_tiers([("verifier", verifier_settings()),
                         ("drafter", drafter_settings(drafters=["dspark-target-dspark", "dspark-target-mtp"]))])
    settings = RouterSettings(verifier=tiers[0].address, drafter=tiers[1].address, methods=["dspark", "mtp"],
                              max_model_len=512)
    try:
        with api_server(settings) as (url, _):
            yield url
    finally:
        stop_tiers(tiers)


def test_a_bench_run_measures_every_arm_and_passes_its_gates(base_url, tmp_path):
    cfg = BenchConfig(base_url, load_workload("mix"), ARMS, concurrency=[1, 3], rates=[8.0], requests=6,
                      max_tokens=16, gamma=4, dist_samples=80)
    ticks = []
    results = asyncio.run(run(cfg, lambda: ticks.append(1)))
    assert len(ticks) == len(ARMS) * (3 * 6 + 80)
    assert [(c["arm"], c["load"]) for c in results["cells"]][:4] == [(a, {"mode": "closed", "concurrency": 1})
                                                                     for a in ARMS]
    for cell in results["cells"]:
        assert cell["summary"]["completed"] == 6 and cell["summary"]["failed"] == 0, cell["errors"]
        assert cell["summary"]["output_throughput"] > 0
    by_arm = {c["arm"]: c["server"] for c in results["cells"] if c["load"] == {"mode": "closed", "concurrency": 1}}
    assert by_arm["none"]["drafts"] == 0  # counters are diffed per cell: no leak from the other arms
    assert by_arm["dspark-fixed"]["tau"] > 1 and by_arm["mtp1"]["mean_verify_len"] <= 1
    assert results["gates"]["greedy_identical"] == {a: True for a in ARMS[1:]}
    assert all(g["passed"] for g in results["gates"]["distribution"].values()), results["gates"]
    # The sampled requests went through speculative cycles, not only the prefill's token.
    assert all(g["draft_tokens"] > 0 for a, g in results["gates"]["distribution"].items() if a != "dspark")
    images = plots(json.loads(json.dumps(results)), tmp_path)  # what results.json holds
    assert images and all(p.stat().st_size > 0 for p in images)
    assert "dspark" in markdown(results, images)


def test_the_greedy_gate_fails_on_one_differing_output():
    cfg = BenchConfig("", load_workload("code"), ["none", "dspark"], concurrency=[1], requests=2)
    same = {("none", "c=1"): ["a", "b"], ("dspark", "c=1"): ["a", "b"]}
    assert greedy_gate(cfg, same) == {"dspark": True}
    assert greedy_gate(cfg, {**same, ("dspark", "c=1"): ["a", "c"]}) == {"dspark": False}
    assert greedy_gate(cfg, {**same, ("dspark", "c=1"): ["a", None]}) == {"dspark": False}  # a failed request


def test_the_permutation_test_tells_distributions_apart():
    rng = random.Random(0)
    a = [rng.choice("xyz") for _ in range(300)]
    b = [rng.choice("xyz") for _ in range(300)]
    skewed = [rng.choice("xxxyz") for _ in range(300)]
    assert permutation_chi2(a, b, rounds=500) > 0.01
    assert permutation_chi2(a, skewed, rounds=500) < 0.01


def test_the_structured_output_arm_is_constrained_and_lossless(base_url):
    """`--dataset json`: every request of every arm carries the JSON schema, and the speculative arm emits the
    plain arm's constrained outputs (the greedy gate)."""
    from benchmarks.serve_bench.runner import body
    from benchmarks.serve_bench.workloads import JSON_ANSWER

    workload = load_workload("json")
    cfg = BenchConfig(base_url, workload, ["none", "dspark-fixed"], concurrency=[2], requests=4, max_tokens=48,
                      gamma=4)
    assert body(cfg, "none", 0)["structured_outputs"] == {"json": JSON_ANSWER}
    results = asyncio.run(run(cfg, lambda: None))
    assert results["gates"]["greedy_identical"] == {"dspark-fixed": True}
    assert all(c["summary"]["completed"] == 4 and c["summary"]["failed"] == 0 for c in results["cells"])

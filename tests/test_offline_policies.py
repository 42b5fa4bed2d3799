"""The in-process router's scheduled policies (in_process/generation.py): threshold and dspark trim blocks through the
same planner as the served router, stay lossless, and dspark verifies fewer drafts when the SPS profile says
verifying costs more."""

from __future__ import annotations

import pytest

from drafter_worker.drafter import Drafter
from in_process.generation import EXPLORE_CYCLES, InProcessRouter
from router.scheduling.policy import Policy
from tests.conftest import make_engine, make_model
from tests.test_drafters import TAPS, draft_model, requests

GAMMA = 6
# (batch tokens, step ms), slow enough that the tiny drafter's own cost is negligible beside a step:
FLAT = [(1, 100.0), (8, 100.0), (64, 100.0)]  # verifying drafts costs nothing
STEEP = [(1, 100.0), (2, 400.0), (4, 1600.0), (8, 6400.0), (64, 51200.0)]  # every token a step carries costs a lot


@pytest.fixture(scope="module")
def target():
    return make_model(layers=3, taps=TAPS)


def _run(target, policy: Policy, sps=None, temperature: float = 0.0, explore: int = EXPLORE_CYCLES):
    router = InProcessRouter(make_engine(target), Drafter(draft_model(target, "dspark")), policy, GAMMA, sps=sps,
                             explore=explore)
    return router.generate(requests(temperature=temperature))


@pytest.mark.parametrize(("policy", "sps"), [(Policy.THRESHOLD, None), (Policy.DSPARK, FLAT), (Policy.DSPARK, STEEP),
                                             (Policy.DSPARK, None)], ids=["threshold", "flat", "steep", "no-profile"])
def test_scheduled_policies_in_process_are_lossless(target, policy, sps):
    plain = InProcessRouter(make_engine(target), policy=Policy.NONE).generate(requests())
    for spec, ref in zip(_run(target, policy, sps), plain, strict=True):
        assert spec.token_ids == ref.token_ids


def test_dspark_verifies_less_where_verifying_costs_more(target):
    # No cold-start exploration: the random drafter's drafts are rarely accepted, and once the estimates learn
    # that, neither profile pays for drafting; the signals alone show how the profile moves ℓ.
    def verified_per_cycle(sps):
        results = _run(target, Policy.DSPARK, sps, explore=0)
        return sum(r.draft_tokens for r in results) / sum(r.cycles for r in results)

    flat, steep = verified_per_cycle(FLAT), verified_per_cycle(STEEP)
    assert steep < flat, (steep, flat)

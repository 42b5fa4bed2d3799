"""n samples of one prompt in process (`GenerationRequest.sample_of`, the API's `n`): the samples copy the first
one's prefill, and each gives what it gives served alone (the copy is a hint to the verifier, not a change of
output); a sample that names no request of the run, or one with another prompt, is refused."""

from __future__ import annotations

import pytest

from drafter_worker.drafter import Drafter
from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.types import SamplingParams
from tests.conftest import make_engine, make_model, random_prompts
from tests.test_drafters import TAPS, draft_model


@pytest.fixture(scope="module")
def target():
    return make_model(layers=3, taps=TAPS)


def _samples(prompt: list[int], n: int, sample_of: str, temperature: float = 1.0) -> list[GenerationRequest]:
    return [GenerationRequest(f"s{i}", prompt, SamplingParams(temperature=temperature, max_tokens=12, seed=i),
                              sample_of=sample_of) for i in range(n)]


@pytest.mark.parametrize(("policy", "temperature"), [(Policy.NONE, 1.0), (Policy.FIXED, 0.0)],
                         ids=["plain-seeded", "speculative-greedy"])
def test_samples_that_copy_the_prefill_equal_samples_served_alone(target, policy, temperature):
    """Token for token where the output is a function of the request: seeded plain sampling, and greedy
    speculation (speculative sampling draws its drafts from the drafter's own stream: equal in distribution
    only, which the χ² tests that use `sample_of` check, tests/test_gemma_drafters.py)."""
    prompt = random_prompts(1)[0]
    proposer = Drafter(draft_model(target, "dspark")) if policy is Policy.FIXED else None

    copies: list[str] = []

    def run(sample_of: str):
        engine = make_engine(target, num_slots=8)
        copy = engine.cache.copy_prefix
        engine.cache.copy_prefix = lambda source, request, length: (copies.append(request), copy(source, request,
                                                                                                 length))[1]
        router = InProcessRouter(engine, proposer, policy, 4)
        return [r.token_ids for r in router.generate(_samples(prompt, 6, sample_of, temperature))]

    alone = run("")
    assert copies == []
    shared = run("s0")
    assert sorted(copies) == ["s1", "s2", "s3", "s4", "s5"]  # each sample but the first copied its prefill
    assert shared == alone
    assert temperature == 0 or len({tuple(t) for t in alone}) > 1  # six seeds, not one sample six times


def test_a_sample_of_no_request_or_of_another_prompt_is_refused(target):
    a, b = random_prompts(2)
    router = InProcessRouter(make_engine(target))
    with pytest.raises(ValueError, match="sample_of"):
        router.generate(_samples(a, 2, "missing"))
    with pytest.raises(ValueError, match="sample_of"):
        router.generate([GenerationRequest("s0", a), GenerationRequest("s1", b, sample_of="s0")])

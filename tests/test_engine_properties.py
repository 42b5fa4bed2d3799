"""Property: whatever the interleaving of requests, drafts, rollbacks and releases, every request
gets exactly its plain greedy output — a neighbour never corrupts another request's cache."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.types import DraftBlock, SamplingParams
from tests.conftest import VOCAB, make_engine

PROMPTS = st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=20)


@pytest.fixture(scope="module")
def reference(tiny_model):
    cache: dict[tuple[int, ...], list[int]] = {}

    def plain(prompt: list[int], max_tokens: int) -> list[int]:
        key = (*prompt, -max_tokens)
        if key not in cache:
            req = GenerationRequest("ref", prompt, SamplingParams(max_tokens=max_tokens))
            cache[key] = InProcessRouter(make_engine(tiny_model), policy=Policy.NONE).generate([req])[0].token_ids
        return cache[key]

    return plain


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompts=st.lists(PROMPTS, min_size=1, max_size=5),
    max_tokens=st.integers(1, 12),
    slots=st.integers(1, 3),
    budget=st.integers(1, 16),
    drafts=st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=5), min_size=1, max_size=8),
    cancel=st.sets(st.integers(0, 4), max_size=2),
)
def test_interleavings_never_corrupt_a_neighbour(tiny_model, reference, prompts, max_tokens, slots, budget,
                                                  drafts, cancel):
    engine = make_engine(tiny_model, num_slots=slots, max_batch_tokens=budget)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens))
    live = {f"r{i}": len(p) for i, p in enumerate(prompts)}  # request → prompt length
    step = 0
    while live:
        for rid in list(live):
            if engine.is_ready(rid):
                engine.submit(rid, DraftBlock(drafts[step % len(drafts)]))
        engine.step()
        step += 1
        if step == 3:  # cancel some requests mid-flight; their slots go to waiting neighbours
            for i in cancel:
                if f"r{i}" in live:
                    engine.release(f"r{i}")
                    del live[f"r{i}"]
        for rid, plen in list(live.items()):
            if engine.is_running(rid) and len(engine.tokens(rid)) - plen >= max_tokens:
                output = engine.tokens(rid)[plen:][:max_tokens]
                assert output == reference(prompts[int(rid[1:])], max_tokens)
                engine.release(rid)
                del live[rid]
    assert engine.cache.usage().slots_used == 0

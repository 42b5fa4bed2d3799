"""n samples of one prompt share its prefill: the copy of the leader's cached prompt is invisible in the output."""

from __future__ import annotations

import pytest

from services.types import SamplingParams
from tests.conftest import make_engine, random_prompts

PROMPT = random_prompts(3)[2] * 2


def _decode(engine, max_tokens: dict[str, int]) -> dict[str, list[int]]:
    """Plain decoding of the requests already added, until each has its max_tokens."""
    out: dict[str, list[int]] = {rid: [] for rid in max_tokens}
    while any(len(out[r]) < n for r, n in max_tokens.items()):
        for rid, n in max_tokens.items():
            if engine.is_ready(rid) and len(out[rid]) < n:
                engine.submit(rid)
        for step in engine.step():
            out[step.request_id] += step.emitted
    return out


def _alone(model, params: SamplingParams) -> list[int]:
    engine = make_engine(model)
    engine.add_request("b", PROMPT, params)
    return _decode(engine, {"b": params.max_tokens})["b"]


def _after_leader(model, params: SamplingParams, leader_prompt: list[int], hint: str):
    """The leader prefilled in one step, then b added naming `hint` → (b's output, b's prefill output)."""
    engine = make_engine(model, max_batch_tokens=256)
    engine.add_request("a", leader_prompt, SamplingParams(max_tokens=8))
    engine.step()  # a's whole prefill and its first token
    engine.add_request("b", PROMPT, params, share_prefix_of=hint)
    (first,) = engine.step()
    tokens = engine.last_batch_tokens
    rest = _decode(engine, {"b": params.max_tokens - 1})["b"]
    return first.emitted + rest, first, tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_sample_that_copies_its_leaders_prompt_equals_the_sample_served_alone(tiny_model, temperature):
    params = SamplingParams(temperature=temperature, seed=2, max_tokens=12)
    got, first, tokens = _after_leader(tiny_model, params, PROMPT, "a")
    assert got == _alone(tiny_model, params)
    assert tokens == 1 and first.feature_start == len(PROMPT) - 1  # only the last prompt position computed
    assert first.features.shape[0] == 1


@pytest.mark.parametrize("hint", ["nobody", "other-prompt"])
def test_an_unusable_hint_is_a_full_prefill_with_the_same_output(tiny_model, hint):
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=10)
    leader = random_prompts(3)[1] if hint == "other-prompt" else PROMPT
    got, first, tokens = _after_leader(tiny_model, params, leader, "a" if hint == "other-prompt" else hint)
    assert got == _alone(tiny_model, params)
    assert tokens == len(PROMPT) and first.feature_start == 0


def test_the_router_prefills_samples_beside_their_leader(tiny_model):
    """Through the router core: the samples wait for the leader's prefill, then copy its cached prompt."""
    import asyncio

    from router.router import Router
    from router.session import PrefixShare, RouterRequest
    from verifier_worker.service import LocalVerifier, VerifierService

    calls = []

    class Spy(LocalVerifier):
        async def prefill(self, call):
            done = await super().prefill(call)
            calls.append((call.request_id, call.share_prefix_of, done.feature_start))
            return done

    async def main():
        service = VerifierService(make_engine(tiny_model, max_batch_tokens=256), batch_window_s=0.0)
        await service.start()
        router = Router(Spy(service), None, set())
        share = PrefixShare("s0")
        reqs = [RouterRequest(PROMPT, SamplingParams(temperature=1.0, seed=j, max_tokens=10), f"s{j}", prefix=share)
                for j in range(3)]

        async def run(req):
            return [t for c in [c async for c in router.generate(req)] for t in c.token_ids]
        together = await asyncio.gather(*(run(r) for r in reversed(reqs)))  # followers first: they wait
        alone = [await run(RouterRequest(PROMPT, r.params, f"a{j}")) for j, r in enumerate(reqs)]
        await service.stop()
        return list(reversed(together)), alone

    together, alone = asyncio.run(main())
    assert together == alone
    first = {rid: (hint, start) for rid, hint, start in calls}
    assert first["s0"] == ("", 0)
    assert first["s1"] == ("s0", len(PROMPT) - 1) and first["s2"] == ("s0", len(PROMPT) - 1)

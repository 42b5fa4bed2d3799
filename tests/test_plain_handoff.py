"""A dspark request handed to a plain run mid-way (RouterConfig.plain_handoff): the verifier runs it ahead from the
hand-off on, its tokens are plain decoding's, and no draft may follow (service, gRPC tier, router)."""

from __future__ import annotations

import asyncio

import pytest

from cluster.launcher import start_tier
from router.router import Router, RouterConfig
from router.scheduling.planner import VerifyPlanner
from router.scheduling.policy import Policy
from router.session import RouterRequest, Speculation
from router.tiers.grpc import GrpcVerifier
from services.calls import PrefillCall, VerifyCall
from services.errors import InvalidRequestError
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import DraftBlock, PlainRun, SamplingParams
from tests.conftest import random_prompts, started_verifier
from tests.tiers import PROMPTS, TARGET, FlakyVerifier, plain_greedy, verifier_settings
from verifier_worker.service import LocalVerifier

GREEDY = SamplingParams(max_tokens=24)
SAMPLED = SamplingParams(max_tokens=24, temperature=1.0, seed=5)


async def _decode(verifier, rid: str, prompt: list[int], params: SamplingParams, handoff_at: int | None,
                  first_draft: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Plain cycles (the first with `first_draft` as its block), handed to PlainRun(6, 3) at cycle `handoff_at`
    → (tokens, tokens per reply). `verifier`: a VerifierService or a router-side tier."""
    pre = await verifier.prefill(PrefillCall(rid, prompt, params))
    tokens, replies, cycle = list(pre.emitted), [], 0
    while len(tokens) < params.max_tokens:
        cycle += 1
        draft = DraftBlock(tokens=first_draft) if cycle == 1 and first_draft else None
        plain = PlainRun(6, 3) if cycle == handoff_at else None
        out = (await verifier.verify(VerifyCall(rid, cycle, draft, plain=plain))).output
        tokens += out.emitted
        replies.append(len(out.emitted))
    await verifier.release(rid)
    return tokens[: params.max_tokens], replies


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_request_handed_to_a_plain_run_mid_way_keeps_plain_decodings_tokens(tiny_model, params):
    prompt = random_prompts(1)[0]

    async def main():
        service = await started_verifier(tiny_model)
        reference, _ = await _decode(service, "ref", prompt, params, None)
        draft = reference[1:4] if params.greedy else None  # a drafted cycle before the hand-off
        handed, replies = await _decode(service, "h", prompt, params, 2, draft)
        await service.stop()
        return reference, handed, replies

    reference, handed, replies = asyncio.run(main())
    assert handed == reference
    assert replies[0] >= 1 and all(3 <= n <= 6 for n in replies[1:-1])  # from the hand-off on: runs of steps


def test_after_the_hand_off_no_draft_is_taken_and_a_bad_hand_off_changes_nothing(tiny_model):
    prompt = random_prompts(1)[0]

    async def main():
        service = await started_verifier(tiny_model)
        first = (await service.prefill(PrefillCall("r", prompt, GREEDY))).emitted
        with pytest.raises(InvalidRequestError, match="empty draft"):
            await service.verify(VerifyCall("r", 1, DraftBlock(tokens=[1, 2]), plain=PlainRun(4, 2)))
        with pytest.raises(InvalidRequestError, match="plain_depth"):
            await service.verify(VerifyCall("r", 1, None, plain=PlainRun(99, 1)))
        out = (await service.verify(VerifyCall("r", 1, None, plain=PlainRun(4, 2)))).output.emitted  # cycle 1 still
        with pytest.raises(InvalidRequestError, match="no drafts"):
            await service.verify(VerifyCall("r", 2, DraftBlock(tokens=[1, 2])))
        more = (await service.verify(VerifyCall("r", 2, None))).output.emitted
        await service.stop()
        return first, out, more

    first, out, more = asyncio.run(main())
    assert len(first) == 1 and len(out) >= 2 and len(more) >= 2


def test_the_hand_off_crosses_the_grpc_tier():
    proc = start_tier("verifier", verifier_settings())
    prompt = TextTokenizer.from_dir(resolve_model(TARGET)).encode(PROMPTS[0])

    async def main():
        verifier = GrpcVerifier(proc.address)
        try:
            return await _decode(verifier, "g", prompt, GREEDY, 2)
        finally:
            await verifier.close()

    try:
        tokens, replies = asyncio.run(main())
    finally:
        proc.stop()
    assert tokens == plain_greedy([prompt], [GREEDY.max_tokens])[0][: GREEDY.max_tokens]
    assert max(replies[1:]) >= 3  # the run's replies carry several steps


class _NeverDrafts(VerifyPlanner):
    """A plan that always finds drafting does not pay at this load."""

    def wants_draft(self, request_id, policy, sla) -> bool:
        return policy is not Policy.DSPARK or sla > 0


class _UnusedDrafter:
    async def release(self, request_id) -> None:
        pass


@pytest.mark.parametrize("handoff", [True, False])
def test_the_router_hands_dspark_requests_that_skip_drafting_to_a_plain_run(tiny_model, handoff):
    prompts = random_prompts(3)

    async def run(router: Router, i: int, p: list[int]) -> tuple[list[int], int]:
        params = SamplingParams(max_tokens=20, temperature=1.0 if i % 2 else 0.0, seed=i)
        chunks = [c async for c in router.generate(RouterRequest(p, params, f"r{i}"))]
        return [t for c in chunks for t in c.token_ids], len(chunks)

    async def main():
        service = await started_verifier(tiny_model)
        config = RouterConfig(default=Speculation("dspark", Policy.DSPARK, 7), plain=PlainRun(4, 2),
                              plain_handoff=handoff)
        router = Router(LocalVerifier(service), _UnusedDrafter(), {"dspark"}, config, planner=_NeverDrafts())
        plain = Router(LocalVerifier(service), None, set(), RouterConfig(plain=None))
        handed = await asyncio.gather(*(run(router, i, p) for i, p in enumerate(prompts)))
        reference = [await run(plain, i, p) for i, p in enumerate(prompts)]
        await service.stop()
        return handed, reference, router.metrics.plain_handoffs.labels("")._value.get()

    handed, reference, handoffs = asyncio.run(main())
    assert [t for t, _ in handed] == [t for t, _ in reference]
    assert handoffs == (3 if handoff else 0)
    if handoff:  # fewer chunks than tokens: the verifier's replies carry runs of steps
        assert all(n < len(t) for t, n in handed)
    else:
        assert all(n == len(t) + 1 for t, n in handed)  # one chunk per token, and the finish


def test_a_handed_off_request_that_loses_its_verifier_is_re_prefilled_as_a_plain_run(tiny_model):
    prompt = random_prompts(1)[0]
    params = SamplingParams(max_tokens=24)

    async def main():
        service = await started_verifier(tiny_model)
        config = RouterConfig(default=Speculation("dspark", Policy.DSPARK, 7), plain=PlainRun(4, 2))
        flaky = FlakyVerifier(service)
        router = Router(flaky, _UnusedDrafter(), {"dspark"}, config, planner=_NeverDrafts())
        chunks = [c async for c in router.generate(RouterRequest(prompt, params, "lost"))]
        plain = Router(LocalVerifier(service), None, set(), RouterConfig(plain=None))
        reference = [t async for c in plain.generate(RouterRequest(prompt, params, "ref")) for t in c.token_ids]
        await service.stop()
        return chunks, reference, router.metrics.verifier_reprefills.labels("")._value.get(), flaky.calls

    chunks, reference, reprefills, calls = asyncio.run(main())
    assert [t for c in chunks for t in c.token_ids] == reference
    assert reprefills == 1 and calls > 3
    assert len(chunks) < len(reference)  # runs of several tokens a reply, before and after the re-prefill

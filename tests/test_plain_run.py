"""Plain decoding run ahead in the verifier (verifier_worker/plain_run.py): the same tokens as one step per
call, several steps per reply when the caller is slow, no step past a stop token or max_tokens, bad use refused."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from router.router import Router, RouterConfig
from router.session import RouterRequest
from router.settings import RouterSettings
from services.calls import PrefillCall, VerifyCall
from services.errors import InvalidRequestError
from services.types import DraftBlock, PlainRun, SamplingParams
from tests.conftest import random_prompts, started_verifier
from verifier_worker.plain_run import MAX_DEPTH
from verifier_worker.service import LocalVerifier, VerifierService

GREEDY = SamplingParams(max_tokens=24)
SAMPLED = SamplingParams(max_tokens=24, temperature=1.0, seed=11)


async def _decode(service: VerifierService, rid: str, prompt: list[int], params: SamplingParams,
                  plain: PlainRun | None, pause_s: float = 0.0, release: bool = True) -> tuple[list[int], list[int]]:
    """A caller of the verifier that sends no drafts → (tokens, tokens per reply); `pause_s` between calls, the
    slot freed at the end unless `release` is false."""
    tokens = list((await service.prefill(PrefillCall(rid, prompt, params, plain=plain))).emitted)
    replies, cycle = [], 0
    while len(tokens) < params.max_tokens and tokens[-1] not in params.stop_token_ids:
        await asyncio.sleep(pause_s)
        cycle += 1
        out = (await service.verify(VerifyCall(rid, cycle, None))).output
        tokens += out.emitted
        replies.append(len(out.emitted))
    if release:
        await service.release(rid)
    return tokens, replies


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_running_ahead_gives_the_tokens_of_one_step_per_call(tiny_model, params):
    prompts = random_prompts(3)

    async def main():
        service = await started_verifier(tiny_model)
        plain = [await _decode(service, f"p{i}", p, params, None) for i, p in enumerate(prompts)]
        ahead = await asyncio.gather(*(_decode(service, f"a{i}", p, params, PlainRun(4, 1), 0.01)
                                       for i, p in enumerate(prompts)))
        spaced = await asyncio.gather(*(_decode(service, f"s{i}", p, params, PlainRun(6, 3))
                                        for i, p in enumerate(prompts)))
        await service.stop()
        return plain, ahead, spaced

    plain, ahead, spaced = asyncio.run(main())
    assert [t for t, _ in ahead] == [t for t, _ in plain] == [t for t, _ in spaced]
    assert all(n == 1 for _, replies in plain for n in replies)
    taken = [n for _, replies in ahead for n in replies]
    assert max(taken) > 1 and max(taken) <= 4  # steps done while the caller slept, at most the depth
    # an interval of 3: every reply waits for 3 steps and takes at most the depth, but the last (the end)
    assert all(3 <= n <= 6 for _, replies in spaced for n in replies[:-1])
    assert all(1 <= replies[-1] <= 6 for _, replies in spaced)


def test_running_ahead_stops_at_a_stop_token_and_at_max_tokens(tiny_model):
    prompt = random_prompts(1)[0]

    async def main():
        service = await started_verifier(tiny_model)
        reference, _ = await _decode(service, "ref", prompt, GREEDY, None)
        stop = reference[5]
        params = SamplingParams(max_tokens=24, stop_token_ids=(stop,))
        tokens, _ = await _decode(service, "stop", prompt, params, PlainRun(8, 4), 0.01, release=False)
        await asyncio.sleep(0.05)  # time for steps that should not happen
        after_stop = service.engine.num_tokens("stop") - len(prompt)
        short = SamplingParams(max_tokens=6)
        await service.prefill(PrefillCall("short", prompt, short, plain=PlainRun(8, 1)))
        await asyncio.sleep(0.05)
        after_max = service.engine.num_tokens("short") - len(prompt)
        await service.stop()
        return reference, stop, tokens, after_stop, after_max

    reference, stop, tokens, after_stop, after_max = asyncio.run(main())
    cut = reference.index(stop) + 1
    assert tokens == reference[:cut] and after_stop == cut
    assert after_max == 6


def test_a_run_ahead_request_refuses_drafts_and_bad_depths_change_nothing(tiny_model):
    prompt = random_prompts(1)[0]

    async def main():
        service = await started_verifier(tiny_model)
        reference, _ = await _decode(service, "ref", prompt, GREEDY, None)
        with pytest.raises(InvalidRequestError, match="plain_depth"):
            await service.prefill(PrefillCall("deep", prompt, GREEDY, plain=PlainRun(MAX_DEPTH + 1, 1)))
        with pytest.raises(InvalidRequestError, match="stream_interval"):
            await service.prefill(PrefillCall("wide", prompt, GREEDY, plain=PlainRun(2, 3)))
        held = service.engine.num_running
        first = (await service.prefill(PrefillCall("r", prompt, GREEDY, plain=PlainRun(2, 1)))).emitted
        with pytest.raises(InvalidRequestError, match="no drafts"):
            await service.verify(VerifyCall("r", 1, DraftBlock(tokens=reference[1:3])))
        rest = (await service.verify(VerifyCall("r", 1, None))).output.emitted
        await service.stop()
        return reference, held, first + rest

    reference, held, tokens = asyncio.run(main())
    assert held == 0  # the refused prefills hold no slot
    assert tokens == reference[: len(tokens)] and len(tokens) >= 2


def test_the_router_runs_plain_requests_ahead_with_the_same_output(tiny_model):
    prompts = random_prompts(4)

    async def main(plain: PlainRun | None):
        service = await started_verifier(tiny_model)
        router = Router(LocalVerifier(service), None, set(), RouterConfig(plain=plain))

        async def run(i, p):
            params = SamplingParams(max_tokens=20, temperature=1.0 if i % 2 else 0.0, seed=i)
            chunks = [c async for c in router.generate(RouterRequest(p, params, f"r{i}"))]
            return [t for c in chunks for t in c.token_ids]
        out = await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
        await service.stop()
        return out

    assert asyncio.run(main(PlainRun(4, 2))) == asyncio.run(main(None))


def test_router_settings_keep_the_interval_within_the_depth():
    assert RouterSettings(plain_depth=8, stream_interval=4).stream_interval == 4
    assert RouterSettings(plain_depth=0, stream_interval=4).plain_depth == 0  # no plain run: the interval is moot
    with pytest.raises(ValidationError, match="stream_interval"):
        RouterSettings(plain_depth=2, stream_interval=4)

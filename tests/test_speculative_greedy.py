"""Speculative greedy output equals plain greedy output token for token (fp32, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from drafter_worker.ngram import NgramProposer
from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.types import FinishReason, SamplingParams
from tests.conftest import VOCAB, make_engine, random_prompts
from tests.drafters import OracleProposer, RandomProposer


def _requests(max_tokens: int = 40, stop: tuple[int, ...] = ()) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens - 3 * i), stop)
        for i, prompt in enumerate(random_prompts(5))
    ]


@pytest.fixture(scope="module")
def plain(tiny_model):
    return InProcessRouter(make_engine(tiny_model), policy=Policy.NONE).generate(_requests())


def _run(model, proposer, gamma, **engine_kw):
    router = InProcessRouter(make_engine(model, **engine_kw), proposer, Policy.FIXED, gamma)
    return router.generate(_requests())


@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("drafter", ["ngram", "random", "oracle"])
def test_speculative_greedy_equals_plain(tiny_model, plain, drafter, gamma):
    proposer = {
        "ngram": lambda: NgramProposer(),
        "random": lambda: RandomProposer(VOCAB),
        "oracle": lambda: OracleProposer({r.request_id: r.prompt_ids + r.token_ids for r in plain}, VOCAB),
    }[drafter]()
    # 3 slots for 5 requests: some wait for a slot; small prefill budget: prompts arrive in chunks.
    spec = _run(tiny_model, proposer, gamma, num_slots=3, max_batch_tokens=10)
    for s, p in zip(spec, plain, strict=True):
        assert s.token_ids == p.token_ids, f"{drafter} γ={gamma} diverged on {s.request_id}"
        assert s.finish_reason == p.finish_reason
    drafted = sum(r.draft_tokens for r in spec)
    accepted = sum(r.accepted_tokens for r in spec)
    assert drafted > 0
    if drafter == "oracle":
        assert accepted > drafted / 3  # speculation really happened: τ well above 1
        assert sum(r.cycles for r in spec) < sum(r.cycles for r in plain)


def test_every_outcome_kind_occurs(tiny_model, plain):
    answers = {r.request_id: r.prompt_ids + r.token_ids for r in plain}
    spec = _run(tiny_model, OracleProposer(answers, VOCAB, error_rate=0.3), 4)
    cycles = sum(r.cycles for r in spec)
    accepted = sum(r.accepted_tokens for r in spec)
    drafted = sum(r.draft_tokens for r in spec)
    assert 0 < accepted < drafted  # some rejections (recovered tokens) and some acceptances
    full = sum(r.accepted_per_pos[3] for r in spec if len(r.accepted_per_pos) > 3)
    assert full > 0  # some cycles accepted all 4 drafts and ended with a bonus token
    assert cycles > 0


def test_stop_token_ends_generation(tiny_model, plain):
    stop = plain[1].token_ids[5]
    reqs = _requests(stop=(stop,))
    for policy, proposer in [(Policy.NONE, None), (Policy.FIXED, NgramProposer())]:
        result = InProcessRouter(make_engine(tiny_model), proposer, policy, 4).generate(reqs)[1]
        first = plain[1].token_ids.index(stop)
        assert result.token_ids == plain[1].token_ids[: first + 1]
        assert result.finish_reason == FinishReason.STOP


def test_max_tokens_is_exact(tiny_model):
    reqs = [GenerationRequest("a", [5, 6, 7], SamplingParams(max_tokens=9))]
    result = InProcessRouter(make_engine(tiny_model), NgramProposer(), Policy.FIXED, 8).generate(reqs)[0]
    assert len(result.token_ids) == 9
    assert result.finish_reason == FinishReason.LENGTH


def _bf16_linears_row_invariant() -> bool:
    torch.manual_seed(0)
    w, x = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(9, 64, dtype=torch.bfloat16)
    one = torch.nn.functional.linear(x[:1], w)[0]
    return all(torch.equal(one, torch.nn.functional.linear(x[:m], w)[0]) for m in (2, 5, 9))


def test_bf16_speculation_is_bit_exact(tiny_model, plain):
    if not _bf16_linears_row_invariant():
        pytest.skip("this CPU's bf16 GEMM gives a row different bits at different row counts")
    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    reqs = _requests()
    base = InProcessRouter(make_engine(model), policy=Policy.NONE).generate(reqs)
    answers = {r.request_id: r.prompt_ids + r.token_ids for r in base}
    spec = InProcessRouter(make_engine(model, num_slots=3, max_batch_tokens=10),
                       OracleProposer(answers, VOCAB), Policy.FIXED, 5).generate(reqs)
    assert [r.token_ids for r in spec] == [r.token_ids for r in base]
    assert sum(r.accepted_tokens for r in spec) > 0

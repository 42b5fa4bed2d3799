"""Logprobs are the target's raw log-softmax at the row that predicted each token, with or without speculation."""

from __future__ import annotations

import pytest
import torch

from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.types import SamplingParams
from tests.conftest import VOCAB, full_forward, make_engine, random_prompts
from tests.drafters import OracleProposer, RandomProposer


def _check_against_dense(model, prompt: list[int], tokens: list[int], lp, top: int, first: int) -> None:
    """lp covers tokens[first:] of prompt + output, each from the dense forward's row before it."""
    full = torch.log_softmax(full_forward(model, prompt + tokens).logits.float(), -1)  # [P+T, V]
    seq = prompt + tokens
    assert len(lp) == len(seq) - first
    for i, pos in enumerate(range(first, len(seq))):
        row = full[pos - 1]
        assert lp.logprobs[i] == pytest.approx(float(row[seq[pos]]), abs=1e-5)
        values, ids = row.topk(top)
        assert lp.top_ids[i] == ids.tolist()
        assert lp.top_logprobs[i] == pytest.approx(values.tolist(), abs=1e-5)


def _requests(params: SamplingParams) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", p, params) for i, p in enumerate(random_prompts(3))]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("drafter", ["none", "random", "oracle"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_output_logprobs_equal_a_dense_forward(tiny_model, temperature, drafter, gamma):
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=16, logprobs=5)
    reqs = _requests(params)
    plain = InProcessRouter(make_engine(tiny_model), policy=Policy.NONE).generate(reqs)
    proposer = {"none": None, "random": RandomProposer(VOCAB),
                "oracle": OracleProposer({r.request_id: r.prompt_ids + r.token_ids for r in plain}, VOCAB)}[drafter]
    router = InProcessRouter(make_engine(tiny_model, num_slots=2), proposer,
                         Policy.NONE if proposer is None else Policy.FIXED, gamma)
    for r in router.generate(reqs):
        _check_against_dense(tiny_model, r.prompt_ids, r.token_ids, r.logprobs, 5, len(r.prompt_ids))
        assert r.prompt_logprobs is None


def test_prompt_logprobs_across_prefill_chunks(tiny_model):
    params = SamplingParams(max_tokens=6, logprobs=0, prompt_logprobs=3)
    # a 7-token prefill budget: every prompt arrives in several chunks
    prompts = [p * 3 for p in random_prompts(3)]  # 9 tokens and more
    reqs = [GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
    results = InProcessRouter(make_engine(tiny_model, max_batch_tokens=7)).generate(reqs)
    for r in results:
        assert len(r.prompt_ids) > 7
        _check_against_dense(tiny_model, r.prompt_ids, [], r.prompt_logprobs, 3, 1)
        assert len(r.logprobs) == len(r.token_ids) and r.logprobs.top_ids[0] == []


def test_logprobs_do_not_change_the_output(tiny_model):
    base = InProcessRouter(make_engine(tiny_model)).generate(_requests(SamplingParams(temperature=1.0, seed=5)))
    asked = InProcessRouter(make_engine(tiny_model)).generate(
        _requests(SamplingParams(temperature=1.0, seed=5, logprobs=20, prompt_logprobs=20)))
    assert [r.token_ids for r in asked] == [r.token_ids for r in base]
    assert all(r.logprobs is None for r in base)

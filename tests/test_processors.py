"""Logits processors inside verification: speculative output equals plain decoding with the same processors.

The reference is written here, independent of services/processors.py: a dense forward of the whole context
per token, each processor applied in a plain Python loop over the vocabulary, as Hugging Face and vLLM define
them. A processor that read a row's own draft, or skipped the drafts before it, diverges from it.
"""

from __future__ import annotations

import math

import pytest
import torch

from drafter_worker.ngram import NgramProposer
from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.sampling import logits_to_probs
from services.types import SamplingParams
from tests.chi2 import token_p_value
from tests.conftest import VOCAB, full_forward, make_engine, make_model, random_prompts
from tests.drafters import FixedDistributionProposer, OracleProposer, RandomProposer

FAMILIES = {
    "repetition": {"repetition_penalty": 1.6},
    "frequency": {"frequency_penalty": 0.9},
    "presence": {"presence_penalty": 1.2},
    "logit_bias": {"logit_bias": ((3, 4.0), (11, -3.0), (20, 2.5))},
    "min_tokens": {"min_tokens": 12, "stop_token_ids": (7, 39)},  # tokens greedy emits early
    "min_p": {"min_p": 0.2},
    "allowed_token_ids": {"allowed_token_ids": tuple(range(0, 96, 3))},
    "bad_words": {"bad_words": ((94,), (7, 7), (25, 29, 25))},  # a token, a pair and a triple greedy emits
}


def _reference_logits(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """One row's processed logits, token by token (the definitions, not the vectorised code)."""
    out = list(logits)
    if params.allowed_token_ids:
        out = [x if v in params.allowed_token_ids else -math.inf for v, x in enumerate(out)]
    for word in params.bad_words:
        if tuple(output[len(output) - (len(word) - 1):]) == word[:-1] or len(word) == 1:
            out[word[-1]] = -math.inf
    for token, bias in params.logit_bias:
        out[token] += bias
    if len(output) < params.min_tokens:
        for token in params.stop_token_ids:
            out[token] = -math.inf
    seen = set(prompt) | set(output)
    for v in range(len(out)):
        if params.repetition_penalty != 1.0 and v in seen:
            out[v] = out[v] / params.repetition_penalty if out[v] > 0 else out[v] * params.repetition_penalty
        count = output.count(v)
        out[v] -= params.frequency_penalty * count + (params.presence_penalty if count else 0.0)
    return out


def _reference_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:
    output: list[int] = []
    while len(output) < params.max_tokens:
        row = full_forward(model, prompt + output).logits[-1].tolist()
        processed = _reference_logits(row, params, prompt, output)
        output.append(max(range(len(processed)), key=processed.__getitem__))
    return output


def _requests(params: SamplingParams, n: int = 3) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", p, params) for i, p in enumerate(random_prompts(n))]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_with_processors_equals_reference_plain_and_speculative(tiny_model, family):
    params = SamplingParams(max_tokens=20, **FAMILIES[family])
    reqs = _requests(params)
    expected = [_reference_greedy(tiny_model, r.prompt_ids, params) for r in reqs]
    plain = InProcessRouter(make_engine(tiny_model, max_batch_tokens=10), policy=Policy.NONE).generate(reqs)
    assert [r.token_ids for r in plain] == expected, f"{family}: plain decoding differs from the reference"
    answers = {r.request_id: r.prompt_ids + e for r, e in zip(reqs, expected, strict=True)}
    for name, proposer in [("oracle", OracleProposer(answers, VOCAB, error_rate=0.2)),
                           ("random", RandomProposer(VOCAB)), ("ngram", NgramProposer())]:
        spec = InProcessRouter(make_engine(tiny_model, num_slots=2), proposer, Policy.FIXED, 4).generate(reqs)
        assert [r.token_ids for r in spec] == expected, f"{family}: {name} speculation differs"
        if name == "oracle":
            assert sum(r.accepted_tokens for r in spec) > 0


def test_processors_change_greedy_output(tiny_model):
    """The processors really act: each family's output differs from unprocessed greedy on some prompt."""
    reqs = _requests(SamplingParams(max_tokens=20))
    base = [r.token_ids for r in InProcessRouter(make_engine(tiny_model)).generate(reqs)]
    for family, fields in FAMILIES.items():
        if family == "min_p":
            continue  # min_p never moves the argmax
        params = SamplingParams(max_tokens=20, **fields)
        out = [r.token_ids for r in InProcessRouter(make_engine(tiny_model)).generate(_requests(params))]
        assert out != base, f"{family} changed nothing"


def test_min_tokens_masks_stop_tokens_until_reached(tiny_model):
    plain = InProcessRouter(make_engine(tiny_model)).generate(_requests(SamplingParams(max_tokens=30)))
    stop = plain[0].token_ids[2]  # a token plain decoding emits early
    params = SamplingParams(max_tokens=30, min_tokens=10, stop_token_ids=(stop,))
    out = InProcessRouter(make_engine(tiny_model)).generate(_requests(params))[0].token_ids
    assert stop not in out[:10]


# ---- sampled: χ² of the 2nd and 3rd token marginals per family ---------------------------------------
SVOCAB, PROMPT = 12, [1, 2, 3]


def _target_next(model, prefix: list[int], params: SamplingParams) -> torch.Tensor:
    row = full_forward(model, prefix).logits[-1].tolist()
    processed = torch.tensor([_reference_logits(row, params, PROMPT, prefix[len(PROMPT):])])
    return logits_to_probs(processed, torch.tensor([params.temperature]), torch.tensor([params.top_k]),
                           torch.tensor([params.top_p]), torch.tensor([params.min_p]))[0]


def _marginals(model, params) -> tuple[torch.Tensor, torch.Tensor]:
    p1 = _target_next(model, PROMPT, params)
    p2, p3 = torch.zeros(SVOCAB), torch.zeros(SVOCAB)
    for t1 in torch.nonzero(p1).flatten().tolist():
        cond2 = _target_next(model, [*PROMPT, t1], params)
        p2 += p1[t1] * cond2
        for t2 in torch.nonzero(cond2).flatten().tolist():
            p3 += p1[t1] * cond2[t2] * _target_next(model, [*PROMPT, t1, t2], params)
    return p2, p3




SAMPLED = {
    "repetition": {"repetition_penalty": 2.0},
    "frequency": {"frequency_penalty": 1.5},
    "presence": {"presence_penalty": 1.5},
    "logit_bias": {"logit_bias": ((8, 2.0), (9, -2.0))},
    "min_tokens": {"min_tokens": 3, "stop_token_ids": (8, 4)},
    "min_p": {"min_p": 0.15},
    "top_p": {"top_p": 0.8},  # the nucleus among the largest logits (services/sampling.py: _nucleus_probs)
    "top_k_top_p": {"top_k": 6, "top_p": 0.85, "min_p": 0.02},  # min-p and top-p among the k largest
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(SAMPLED))
def test_sampled_speculation_with_processors_keeps_the_distribution(family):
    model = make_model(vocab=SVOCAB, layers=1, hidden=32, seed=5)
    params = dict(temperature=1.0, max_tokens=3, **SAMPLED[family])
    n = 1500
    reqs = [GenerationRequest(f"r{i}", PROMPT, SamplingParams(seed=i, **params)) for i in range(n)]
    # A fixed sparse q far from p: rejections (recovered tokens) at every position.
    router = InProcessRouter(make_engine(model, num_slots=64, max_len=16, max_batch_tokens=512, max_waiting=4096),
                         FixedDistributionProposer([8, 9, 2, 5], [0.5, 0.3, 0.15, 0.05]), Policy.FIXED, gamma=3)
    results = router.generate(reqs)
    assert sum(r.draft_tokens - r.accepted_tokens for r in results) > 0
    p2, p3 = _marginals(model, SamplingParams(**params))
    assert token_p_value(p2, [r.token_ids[1] for r in results]) > 1e-3, family
    assert token_p_value(p3, [r.token_ids[2] for r in results]) > 1e-3, family

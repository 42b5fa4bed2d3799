"""Sampled speculative decoding through the whole engine keeps the target's distribution."""

from __future__ import annotations

import pytest
import torch

from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.sampling import logits_to_probs
from services.types import SamplingParams
from tests.chi2 import token_p_value
from tests.conftest import full_forward, make_engine, make_model
from tests.drafters import FixedDistributionProposer

VOCAB, PROMPT = 12, [1, 2, 3]
PARAMS = {"temperature": 0.9, "top_k": 8}


@torch.no_grad()
def _target_next(model, prefix: list[int]) -> torch.Tensor:
    logits = full_forward(model, prefix).logits[-1:]  # [1, V]
    return logits_to_probs(logits, torch.tensor([PARAMS["temperature"]]), torch.tensor([PARAMS["top_k"]]),
                           torch.tensor([1.0]))[0]


def _marginals(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact marginals of the 2nd and 3rd generated tokens."""
    p1 = _target_next(model, PROMPT)
    p2, p3 = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for t1 in range(VOCAB):
        if p1[t1] == 0:
            continue
        cond2 = _target_next(model, [*PROMPT, t1])
        p2 += p1[t1] * cond2
        for t2 in range(VOCAB):
            if cond2[t2] > 0:
                p3 += p1[t1] * cond2[t2] * _target_next(model, [*PROMPT, t1, t2])
    return p2, p3




@pytest.mark.slow
def test_speculative_sampling_through_engine_matches_target():
    # A systematic sparse q, far from p: a rule that mishandles rejections shows at p < 1e-60 here.
    model = make_model(vocab=VOCAB, layers=1, hidden=32, seed=5)
    n = 2500
    requests = [GenerationRequest(f"r{i}", PROMPT, SamplingParams(max_tokens=3, seed=i, **PARAMS))
                for i in range(n)]
    router = InProcessRouter(make_engine(model, num_slots=64, max_len=16, max_batch_tokens=512, max_waiting=4096),
                         FixedDistributionProposer([8, 9, 2, 5], [0.5, 0.3, 0.15, 0.05]), Policy.FIXED, gamma=3)
    results = router.generate(requests)
    assert sum(r.accepted_tokens for r in results) > 0
    assert sum(r.draft_tokens - r.accepted_tokens for r in results) > 0
    p2, p3 = _marginals(model)
    assert token_p_value(p2, [r.token_ids[1] for r in results]) > 1e-3
    assert token_p_value(p3, [r.token_ids[2] for r in results]) > 1e-3

"""The four drafters shipped for Gemma 3 270M (`models/gemma-3-270m-*`, trained here on its own rollouts; the
target under the Gemma Terms of Use): lossless against it — greedy speculative output equals plain greedy output
token for token in bf16 (as served) and fp32, with drafts accepted; sampled output keeps the target's
distribution of the second and third generated tokens, the first two of cycles (χ², top-k 8 so the exact
marginals are a few forwards), in the dtype served on this machine (bf16 where it is native, fp32 elsewhere,
`services/loader.py: resolve_dtype`: emulated bf16 made these four tests 6 minutes on an AVX2-only CPU); no
draft outside a drafter's vocabulary, whose ids map back to the target's exactly."""

from __future__ import annotations

import pytest
import torch

from drafter_worker.checkpoint import drafter_config, load_drafter
from drafter_worker.drafter import Drafter
from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.loader import load_model, resolve_dtype
from services.registry import resolve_model
from services.sampling import logits_to_probs
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from tests.chi2 import token_p_value
from tests.conftest import make_engine, next_token_logits

pytestmark = pytest.mark.slow
MODEL = "gemma-3-270m"
METHODS = ["dspark", "dflash", "eagle3", "mtp"]
PROMPTS = ["def fibonacci(n):", "<start_of_turn>user\nWhat is 12 + 30?<end_of_turn>\n<start_of_turn>model\n",
           "import numpy as np\n\n"]
TOKENS = 24
SAMPLED = {"temperature": 1.0, "top_k": 8}
SERVED = str(resolve_dtype("auto")).removeprefix("torch.")  # "bfloat16" or "float32"


@pytest.fixture(scope="module")
def tok():
    return TextTokenizer.from_dir(resolve_model(MODEL))


@pytest.fixture(scope="module")
def targets():
    taps = drafter_config(resolve_model(f"{MODEL}-dspark")).tap_layers
    return {dtype: load_model(resolve_model(MODEL), dtype, "cpu", tap_layers=taps) for dtype in ("bfloat16", "float32")}


def _generate(model, prompts, params, proposer=None, observer=None, gamma=7):
    engine = make_engine(model, num_slots=min(64, len(prompts)), max_len=160, max_batch_tokens=1024,
                         max_waiting=4096)
    requests = [GenerationRequest(f"r{i}", p, SamplingParams(**params, seed=i)) for i, p in enumerate(prompts)]
    return _run(engine, requests, proposer, observer, gamma)


def _run(engine, requests, proposer=None, observer=None, gamma=7):
    router = (InProcessRouter(engine, proposer, Policy.FIXED, gamma, observer=observer) if proposer
              else InProcessRouter(engine))
    return router.generate(requests)


@pytest.fixture(scope="module")
def plain_greedy(targets, tok) -> dict[str, list[list[int]]]:
    """dtype → plain greedy output of each prompt (what every drafter's speculative greedy must equal)."""
    prompts = [tok.encode(p) for p in PROMPTS]
    return {dtype: [r.token_ids for r in _generate(model, prompts, {"max_tokens": TOKENS})]
            for dtype, model in targets.items()}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_speculative_equals_plain(targets, tok, plain_greedy, method, dtype):
    model = targets[dtype]
    prompts = [tok.encode(p) for p in PROMPTS]
    draft_model, calibration = load_drafter(f"{MODEL}-{method}", model, dtype)
    drafted: list[int] = []
    spec = _generate(model, prompts, {"max_tokens": TOKENS}, Drafter(draft_model, calibration),
                     lambda rid, block, out: drafted.extend(block.tokens if block else []))
    assert [r.token_ids for r in spec] == plain_greedy[dtype]
    assert sum(r.accepted_tokens for r in spec) > 0  # it drafted, and well enough to be accepted
    ids = torch.tensor(drafted)
    assert bool((draft_model.draft_ids(ids) < draft_model.draft_vocab).all())  # never outside its vocabulary
    vocab = torch.arange(draft_model.draft_vocab)
    assert torch.equal(draft_model.draft_ids(draft_model.to_target(vocab)), vocab)


def _next(model, prefixes: list[list[int]]) -> torch.Tensor:
    """[B, V]: the served distribution of the token after each prefix."""
    logits = next_token_logits(model, prefixes).float()
    b = len(prefixes)
    return logits_to_probs(logits, torch.full((b,), SAMPLED["temperature"]), torch.full((b,), SAMPLED["top_k"]),
                           torch.ones(b))


@pytest.fixture(scope="module")
def marginals(targets, tok) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's exact distributions of the second and third generated tokens (as served), summed over the
    top-8 paths to them: three batched forwards (1, 8 and 64 prefixes) for the four drafters."""
    model, prompt = targets[SERVED], tok.encode(PROMPTS[1])
    p1 = _next(model, [prompt])[0]  # the first token comes from the prefill; the second and third from cycles
    firsts = torch.nonzero(p1).flatten().tolist()
    cond2 = _next(model, [[*prompt, t1] for t1 in firsts])  # [8, V]
    p2 = (p1[firsts, None] * cond2).sum(0)
    paths = [(i, t1, t2) for i, t1 in enumerate(firsts) for t2 in torch.nonzero(cond2[i]).flatten().tolist()]
    cond3 = _next(model, [[*prompt, t1, t2] for _, t1, t2 in paths])  # [64, V]
    weights = torch.tensor([p1[t1] * cond2[i, t2] for i, t1, t2 in paths])
    return p2, (weights[:, None] * cond3).sum(0)


@pytest.mark.parametrize("method", METHODS)
def test_sampled_speculative_output_keeps_the_target_distribution(targets, tok, marginals, method):
    model = targets[SERVED]
    prompt = tok.encode(PROMPTS[1])
    draft_model, calibration = load_drafter(f"{MODEL}-{method}", model, SERVED)
    n = 256  # samples of one prompt, all at once, copying the first one's prefill (the API's `n`)
    engine = make_engine(model, num_slots=n, max_len=len(prompt) + 16, max_batch_tokens=2048, max_waiting=n)
    requests = [GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=3, seed=i, **SAMPLED), sample_of="r0")
                for i in range(n)]
    results = _run(engine, requests, Drafter(draft_model, calibration))
    assert sum(r.accepted_tokens for r in results) > 0
    assert sum(r.draft_tokens - r.accepted_tokens for r in results) > 0  # rejections too: the rule is exercised
    p2, p3 = marginals
    assert token_p_value(p2, [r.token_ids[1] for r in results]) > 1e-3
    assert token_p_value(p3, [r.token_ids[2] for r in results]) > 1e-3

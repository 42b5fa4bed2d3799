"""Small cores: the n-gram drafter, the verify-length policies and the tokenizer wrapper."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter_worker.ngram import NgramProposer
from router.scheduling.planner import VerifyPlanner
from router.scheduling.policy import Policy, max_verify_len
from services.tokenizer import TextTokenizer
from services.types import DraftBlock
from training.tiny_model import build_tiny_model


def test_ngram_prefers_the_longest_suffix_match():
    tokens = [1, 2, 3, 9, 9, 2, 3, 4, 5, 6, 1, 2, 3]
    # the suffix [1, 2, 3] occurred at 0 and is followed by 9 9 2; the shorter [2, 3] would give 4 5 6
    assert NgramProposer(max_n=3).lookup(tokens, 3) == [9, 9, 2]
    assert NgramProposer(max_n=2).lookup(tokens, 3) == [4, 5, 6]  # most recent match of [2, 3]


def test_ngram_takes_a_full_continuation_over_a_more_recent_short_one():
    tokens = [7, 8, 5, 5, 5, 5]
    assert NgramProposer(max_n=1).lookup(tokens, 3) == [5, 5, 5]  # the overlap with the suffix is fine
    assert NgramProposer(max_n=1).lookup([4, 5, 6, 5], 3) == [6, 5]  # only a short one exists


def test_ngram_no_match_and_batching():
    prop = NgramProposer(min_n=2, max_n=3)
    assert prop.lookup([1, 2, 3, 4], 4) == []
    blocks = prop.propose({"a": [1, 2, 1, 2], "b": [5]}, 2)
    assert blocks["a"].tokens == [1, 2] and blocks["a"].q_ids is None  # deterministic → one-hot q
    assert blocks["b"].tokens == []
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)


def test_policies():
    assert max_verify_len(Policy.NONE, 4, 100) == 0
    assert max_verify_len(Policy.FIXED, 4, 100) == 4
    assert max_verify_len(Policy.FIXED, 4, 3) == 2  # a cycle emits up to ℓ + 1 tokens
    assert max_verify_len(Policy.FIXED, 4, 1) == 0
    def verify_len(policy, block_len, bound):  # ℓ as the planner decides it, the one place that does
        block = DraftBlock(list(range(1, block_len + 1)), confidences=[0.5] * block_len)
        return VerifyPlanner().decide("r", policy, "ngram", True, block, bound).verify_len
    assert verify_len(Policy.FIXED, 3, 4) == 3
    assert verify_len(Policy.FIXED, 6, 4) == 4
    assert verify_len(Policy.NONE, 6, 4) == 0


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tok"), vocab_size=400, layers=1)


def test_tokenizer_round_trip_and_specials(tok_dir):
    tok = TextTokenizer.from_dir(tok_dir)
    text = "def f(x):\n    return x ** 2  # ünïcode ✓\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == 400
    assert tok.eos_token_ids == (json.loads((tok_dir / "generation_config.json").read_text())["eos_token_id"],)
    assert tok.bos_token_id is None


def test_tokenizer_adds_bos_when_configured(tok_dir):
    cfg = tok_dir / "tokenizer_config.json"
    raw = json.loads(cfg.read_text())
    cfg.write_text(json.dumps({**raw, "add_bos_token": True, "bos_token": "<|pad|>"}))
    try:
        tok = TextTokenizer.from_dir(tok_dir)
        assert tok.encode("x")[0] == tok.bos_token_id is not None
    finally:
        cfg.write_text(json.dumps(raw))


def _naive_lookup(tokens: list[int], gamma: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        best: list[int] = []
        for start in range(len(tokens) - n - 1, -1, -1):  # most recent first
            if tokens[start : start + n] == tokens[-n:]:
                follow = tokens[start + n : start + n + gamma]
                if len(follow) > len(best):
                    best = follow
                if len(best) == gamma:
                    break
        if best:
            return best
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=40), st.integers(1, 6), st.integers(1, 3), st.integers(0, 3))
def test_ngram_matches_the_naive_definition(tokens, gamma, min_n, extra):
    prop = NgramProposer(min_n=min_n, max_n=min_n + extra)
    assert prop.lookup(tokens, gamma) == _naive_lookup(tokens, gamma, min_n, min_n + extra)

"""The acceptance rule: hand cases, filters, and statistical exactness of rejection sampling."""

from __future__ import annotations

import itertools

import pytest
import torch

from services.sampling import (
    accept_greedy,
    accept_stochastic,
    densify,
    logits_to_probs,
    sample,
    truncate_to_sparse,
)
from services.types import OutcomeKind, SamplingParams
from tests.chi2 import chisquare


def test_greedy_hand_cases():
    assert accept_greedy([5, 6, 7], [5, 6]) == (2, 7, OutcomeKind.BONUS)
    assert accept_greedy([5, 6, 7], [5, 9]) == (1, 6, OutcomeKind.RECOVERED)
    assert accept_greedy([5, 6, 7], [1, 6]) == (0, 5, OutcomeKind.RECOVERED)
    assert accept_greedy([4], []) == (0, 4, OutcomeKind.BONUS)


def test_stochastic_hand_cases():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.5, 0.5, 0.0]])
    assert accept_stochastic(p, [1], q) == (1, 2, OutcomeKind.BONUS)  # p(x)/q(x) = 2: always accepted
    assert accept_stochastic(p, [0], q) == (0, 1, OutcomeKind.RECOVERED)  # p(x) = 0: always rejected
    assert accept_stochastic(p[:1], [], q[:0]) == (0, 1, OutcomeKind.BONUS)


def test_logits_to_probs_filters():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0]])
    probs = logits_to_probs(
        logits,
        temperature=torch.tensor([0.0, 1.0, 0.5]),
        top_k=torch.tensor([0, 2, 0]),
        top_p=torch.tensor([1.0, 1.0, 0.8]),
    )
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]  # greedy is one-hot at the argmax
    expected_topk = torch.softmax(torch.tensor([3.0, 2.0]), -1)
    torch.testing.assert_close(probs[1, [1, 2]], expected_topk)
    assert probs[1, [0, 3]].sum() == 0
    # T = 0.5: softmax([2, 6, 4, 0]) ≈ [.016, .867, .117, .0003]; top-p 0.8 keeps only the top token
    assert probs[2].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert torch.allclose(probs.sum(-1), torch.ones(3))


def test_a_rows_filter_does_not_depend_on_the_other_rows():
    """Only the rows with top-k/top-p on are sorted: each row's probabilities are the bits it gets alone."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 500, generator=g) * 3
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.0, 0.0, 1.3])
    top_k = torch.tensor([0, 0, 40, 0, 5, 0])
    top_p = torch.tensor([0.9, 0.95, 1.0, 1.0, 1.0, 0.5])
    together = logits_to_probs(logits, temperature, top_k, top_p)
    for r in range(6):
        alone = logits_to_probs(logits[r : r + 1], temperature[r : r + 1], top_k[r : r + 1], top_p[r : r + 1])
        assert torch.equal(together[r], alone[0])
    assert (together[1] == 0).any() and (together[5] > 0).sum() < (together[3] > 0).sum()


@pytest.mark.parametrize("vocab", [50, 4000, 262_144])
def test_top_k_alone_keeps_what_the_sort_keeps(monkeypatch, vocab):
    """Top-k without top-p is computed from each row's k largest logits: the same tokens kept as by the full sort
    (ties at the k-th value kept, logits far below the top at probability 0 either way), the same probabilities to
    the last places, and each row's bits those it gets alone, beside rows of other k or of other filters."""
    import services.sampling as sampling

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=g) * torch.tensor([1.0, 3, 10, 30, 1, 1, 100, 1]).unsqueeze(-1)
    logits[:, :7] = logits[:, 7:14]  # ties
    logits[7] = -1e30
    logits[7, 3] = 0.0
    temperature, top_k = torch.rand(8, generator=g) + 0.2, torch.tensor([1, 2, 7, 8, 40, 64, 3, 5])
    fast = logits_to_probs(logits, temperature, top_k, torch.ones(8))
    for r in range(8):
        assert torch.equal(fast[r], logits_to_probs(logits[r : r + 1], temperature[r : r + 1], top_k[r : r + 1],
                                                    torch.ones(1))[0])
    mixed_p = torch.tensor([1.0, 0.9, 1, 1, 0.5, 1, 1, 1])  # rows 1 and 4 through the sort: the others unchanged
    mixed = logits_to_probs(logits, temperature, top_k, mixed_p)
    assert torch.equal(mixed[[0, 2, 3, 5, 6, 7]], fast[[0, 2, 3, 5, 6, 7]])
    monkeypatch.setattr(sampling, "_TOPK_AT_MOST", 0)  # every row through the sort
    sorted_ = logits_to_probs(logits, temperature, top_k, torch.ones(8))
    assert torch.equal(fast > 0, sorted_ > 0)
    torch.testing.assert_close(fast, sorted_, rtol=1e-6, atol=1e-7)
    assert ((fast > 0).sum(-1) >= top_k.clamp(max=1)).all()


@pytest.mark.parametrize("vocab", [300, 262_144])
def test_top_p_and_min_p_after_top_k_keep_what_the_sort_keeps(monkeypatch, vocab):
    """With top-k on, min-p and top-p are decided among the k largest logits: the tokens the full sort keeps, the
    same probabilities to the last places, each row's bits its own beside rows of other parameters."""
    import services.sampling as sampling

    g = torch.Generator().manual_seed(vocab + 1)
    logits = torch.randn(8, vocab, generator=g) * torch.tensor([1.0, 2, 3, 5, 1, 2, 8, 0.5]).unsqueeze(-1)
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.9, 1.0, 1.1, 1.0])
    top_k = torch.tensor([40, 40, 8, 64, 20, 3, 40, 100])
    top_p = torch.tensor([0.95, 0.5, 1.0, 0.9, 0.3, 0.99, 0.8, 0.7])
    min_p = torch.tensor([0.0, 0.05, 0.2, 0.0, 0.1, 0.0, 0.01, 0.02])
    fast = logits_to_probs(logits, temperature, top_k, top_p, min_p)
    for r in range(8):
        alone = logits_to_probs(*(t[r : r + 1] for t in (logits, temperature, top_k, top_p, min_p)))
        assert torch.equal(fast[r], alone[0])
    monkeypatch.setattr(sampling, "_TOPK_AT_MOST", 0)
    sorted_ = logits_to_probs(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(fast > 0, sorted_ > 0)
    torch.testing.assert_close(fast, sorted_, rtol=1e-6, atol=1e-7)
    kept = (fast > 0).sum(-1)
    assert ((kept >= 1) & (kept <= top_k)).all() and (kept < top_k).any()  # top-p and min-p cut some rows


@pytest.mark.parametrize("vocab", [300, 262_144])
def test_top_p_alone_keeps_what_the_sort_keeps(monkeypatch, vocab):
    """Top-p without top-k looks for the nucleus among a row's largest logits and sorts the row only when the
    nucleus is wider (row 3, nearly flat): the same tokens kept as by the sort, the same probabilities to the last
    places, each row's bits its own."""
    import services.sampling as sampling

    g = torch.Generator().manual_seed(vocab + 2)
    logits = torch.randn(6, vocab, generator=g) * torch.tensor([1.0, 3, 6, 0.05, 2, 4]).unsqueeze(-1)
    temperature = torch.tensor([1.0, 0.8, 1.2, 1.0, 0.5, 1.0])
    top_k, top_p = torch.zeros(6, dtype=torch.long), torch.tensor([0.9, 0.5, 0.95, 0.9, 0.99, 0.3])
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.1, 0.0])
    fast = logits_to_probs(logits, temperature, top_k, top_p, min_p)
    for r in range(6):
        alone = logits_to_probs(*(t[r : r + 1] for t in (logits, temperature, top_k, top_p, min_p)))
        assert torch.equal(fast[r], alone[0])
    monkeypatch.setattr(sampling, "_nucleus_alone", lambda temperature, *_: torch.zeros_like(temperature).bool())
    sorted_ = logits_to_probs(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(fast > 0, sorted_ > 0)
    torch.testing.assert_close(fast, sorted_, rtol=1e-6, atol=1e-7)
    kept = (fast > 0).sum(-1)
    assert (kept < vocab).all() and kept[3] > min(vocab // 2, sampling._NUCLEUS_K)


def test_top_k_ties_at_the_kth_value_keep_every_tied_token():
    inf = float("-inf")
    logits = torch.tensor([[4.0, 1.0, 3.0, 3.0, 0.0], [4.0, 1.0, 3.0, 2.0, 0.0], [inf, 1.0, inf, inf, inf]])
    probs = logits_to_probs(logits, torch.ones(3), torch.tensor([2, 2, 3]), torch.ones(3))
    assert (probs[0] > 0).tolist() == [True, False, True, True, False]  # 3.0 twice at the 2nd place: both kept
    assert (probs[1] > 0).tolist() == [True, False, True, False, False]
    assert probs[2].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]  # fewer allowed tokens than k (a grammar's mask)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))


def test_sparse_round_trip():
    probs = torch.softmax(torch.randn(3, 50), -1)
    ids, sparse = truncate_to_sparse(probs, 8)
    assert ids.shape == sparse.shape == (3, 8)
    dense = densify(ids, sparse, 50)
    torch.testing.assert_close(dense.sum(-1), torch.ones(3))
    assert (dense > 0).sum(-1).tolist() == [8, 8, 8]
    assert torch.equal(dense.argmax(-1), probs.argmax(-1))


def test_sampling_params_are_validated():
    from services.errors import InvalidRequestError

    for bad in ({"temperature": -1}, {"top_p": 0.0}, {"top_k": -2}, {"max_tokens": 0},
                {"temperature": float("nan")}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)


# ---- statistics: a Markov-chain target, a different truncated Markov-chain drafter -----------------
V, GAMMA, LENGTH, ANCHOR = 5, 3, 3, 0


def _chains(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)  # [V, V] p(next | prev)
    draft = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    ids, probs = truncate_to_sparse(draft, 3)  # q' has 3 of the 5 tokens in its support
    return target, densify(ids, probs, V)  # [V, V] each


def _generate(target, draft, rule, n: int, seed: int = 0) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        seq = [ANCHOR]
        while len(seq) <= LENGTH:
            drafts = []
            for _ in range(GAMMA):
                drafts.append(int(sample(draft[(drafts or seq)[-1]][None], g)[0]))
            p = target[[seq[-1], *drafts]]  # [γ+1, V]
            q = draft[[seq[-1], *drafts[:-1]]]  # [γ, V]
            accepted, token, _ = rule(p, drafts, q, g)
            seq += [*drafts[:accepted], token]
        samples.append(tuple(seq[1 : LENGTH + 1]))
    return samples


def _p_value(target, samples) -> float:
    cells = list(itertools.product(range(V), repeat=LENGTH))
    expected = []
    for cell in cells:
        prob, prev = 1.0, ANCHOR
        for t in cell:
            prob, prev = prob * float(target[prev, t]), t
        expected.append(prob * len(samples))
    counts = {c: 0 for c in cells}
    for s in samples:
        counts[s] += 1
    keep = [i for i, e in enumerate(expected) if e >= 5]  # chi-square needs populated cells
    obs = [counts[cells[i]] for i in keep]
    exp = [expected[i] for i in keep]
    rest_obs, rest_exp = len(samples) - sum(obs), len(samples) - sum(exp)
    return chisquare([*obs, rest_obs], [*exp, rest_exp]).pvalue


def _no_residual(p, drafts, q, g):
    """Negative control: on rejection, resample from p instead of norm(max(0, p - q)). Biased."""
    accepted, token, kind = accept_stochastic(p, drafts, q, g)
    if kind is OutcomeKind.RECOVERED:
        token = int(sample(p[accepted][None], g)[0])
    return accepted, token, kind


@pytest.mark.slow
def test_emitted_tokens_follow_the_target_distribution():
    target, draft = _chains()
    samples = _generate(target, draft, accept_stochastic, n=6_000)
    assert _p_value(target, samples) > 1e-3
    # the control shows the test has the power to see a wrong rule
    assert _p_value(target, _generate(target, draft, _no_residual, n=3_000, seed=1)) < 1e-6


def test_typical_p_equals_hugging_faces_warper():
    """Locally typical sampling against transformers' own TypicalLogitsWarper (the reference program), after
    temperature, per row, rows with typical_p = 1 untouched."""
    from transformers.generation.logits_process import TypicalLogitsWarper

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g) * 3
    logits[1, :10] = float("-inf")  # a row top-k / top-p already cut
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0])
    mass = torch.tensor([0.9, 0.5, 0.2, 1.0])
    got = logits_to_probs(logits, temps, torch.zeros(4, dtype=torch.long), torch.ones(4), None, mass)
    for r in range(4):
        scaled = logits[r : r + 1] / temps[r]
        want = scaled if mass[r] == 1 else TypicalLogitsWarper(float(mass[r]))(None, scaled.clone())
        torch.testing.assert_close(got[r], want.softmax(-1)[0])
    assert bool((got[1:3] == 0).any())  # it cut something
    with pytest.raises(Exception, match="typical_p"):
        SamplingParams(temperature=1.0, typical_p=0.0)

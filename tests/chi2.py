"""The χ² test the distribution tests share: observed token ids against an exact distribution."""

from __future__ import annotations

import torch


def chisquare(observed, expected):
    """scipy's χ² test, loaded on use: each pytest-xdist worker collects every test module, and scipy.stats cost
    1.2 s of each worker's collection here."""
    from scipy.stats import chisquare as test

    return test(observed, expected)


def token_p_value(expected: torch.Tensor, observed: list[int]) -> float:
    """p-value of `observed` ids under `expected` [V] (cells expecting fewer than 5 pooled into one)."""
    counts = torch.bincount(torch.tensor(observed), minlength=len(expected)).double()
    exp = expected.double() * len(observed)
    keep = exp >= 5
    obs, e = counts[keep].tolist(), exp[keep].tolist()
    if exp[~keep].sum() > 0:
        obs.append(float(counts[~keep].sum()))
        e.append(float(exp[~keep].sum()))
    return chisquare(obs, [x * sum(obs) / sum(e) for x in e]).pvalue

"""The χ² test the distribution tests share: observed token ids against an exact distribution."""

from __future__ import annotations

import torch
from scipy.stats import chisquare


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

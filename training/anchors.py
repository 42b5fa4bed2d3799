"""Anchor sampling and block labels (DeepSpec's block construction).

An anchor is a position p inside a response whose next token is in the response too. Block a covers
slots k = 0..γ−1 predicting the token at anchor_a + k + 1; its eval mask is the contiguous prefix of
slots whose label exists and lies in the response.
"""

from __future__ import annotations

import torch


def sample_anchors(loss_mask: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """loss_mask [S] bool → up to `count` anchor positions [A], uniform without replacement, ascending."""
    candidates = torch.nonzero(loss_mask[:-1] & loss_mask[1:]).flatten()  # [C]
    keep = torch.randperm(len(candidates), generator=generator)[:count]
    return candidates[keep].sort().values


def block_labels(ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, gamma: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, loss_mask [S], anchors [A] → labels [A, γ] (0 where absent) and eval_mask [A, γ] bool."""
    idx = anchors[:, None] + 1 + torch.arange(gamma, device=ids.device)  # [A, γ] label positions
    inside = idx < len(ids)
    safe = idx.clamp(max=len(ids) - 1)
    valid = inside & loss_mask[safe]
    eval_mask = valid.int().cumprod(dim=1).bool()  # only the contiguous valid prefix is supervised
    return torch.where(inside, ids[safe], 0), eval_mask

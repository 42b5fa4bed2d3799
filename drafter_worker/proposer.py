"""What the router needs from any drafter, in-process, and what the hosted ones accept (a replica's limits)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.types import Proposer


class StatelessProposer:
    """Base of drafters that read tokens only: nothing to commit or release."""

    def commit(self, request_id: str, feature_start: int, features: torch.Tensor | None) -> None:
        """Features are not used."""

    def release(self, request_id: str) -> None:
        """Keeps no per-request state."""


@dataclass(frozen=True, slots=True)
class DraftLimits:
    """What the hosted draft models accept; None where no hosted proposer has a model (n-gram, test fakes)."""

    vocab_size: int | None = None
    feature_width: int | None = None  # num_taps * hidden
    positions: int | None = None  # size of the RoPE table: every drafted position must stay below it


def model_limits(proposers: dict[str, Proposer]) -> DraftLimits:
    """The limits of the first proposer with a draft model: a replica's drafters share one target and its taps."""
    for proposer in proposers.values():
        model = getattr(proposer, "model", None)
        if model is not None:
            return DraftLimits(model.config.vocab_size, model.feature_width, model.config.max_context)
    return DraftLimits()

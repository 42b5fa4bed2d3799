"""What the router needs from any drafter, in-process."""

from __future__ import annotations

from typing import Protocol

import torch

from services.types import DraftBlock, SamplingParams


class Proposer(Protocol):
    """Proposes draft blocks for many requests at once.

    `contexts` maps request id → its committed tokens (the last one is the anchor); `params` gives each
    request's sampling parameters (drafts are sampled at the request's temperature). A drafter may return a
    shorter block than γ (even an empty one) when it has nothing to propose. `commit` hands over the target
    features of newly committed positions (rows from `feature_start` on), which model drafters condition on.
    """

    def propose(self, contexts: dict[str, list[int]], gamma: int,
                params: dict[str, SamplingParams] | None = None) -> dict[str, DraftBlock]: ...

    def commit(self, request_id: str, feature_start: int, features: torch.Tensor | None) -> None: ...

    def release(self, request_id: str) -> None: ...


class StatelessProposer:
    """Base of drafters that read tokens only: nothing to commit or release."""

    def commit(self, request_id: str, feature_start: int, features: torch.Tensor | None) -> None:
        """Features are not used."""

    def release(self, request_id: str) -> None:
        """Keeps no per-request state."""

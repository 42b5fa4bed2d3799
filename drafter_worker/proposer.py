"""What the router needs from any drafter, in-process."""

from __future__ import annotations

import torch


class StatelessProposer:
    """Base of drafters that read tokens only: nothing to commit or release."""

    def commit(self, request_id: str, feature_start: int, features: torch.Tensor | None) -> None:
        """Features are not used."""

    def release(self, request_id: str) -> None:
        """Keeps no per-request state."""

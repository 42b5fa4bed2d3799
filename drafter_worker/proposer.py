"""What the router needs from any drafter, in-process."""

from __future__ import annotations

from typing import Protocol

from services.types import DraftBlock


class Proposer(Protocol):
    """Proposes draft blocks for many requests at once.

    `contexts` maps request id → its committed tokens (the last one is the anchor). A drafter may
    return a shorter block than γ (even an empty one) when it has nothing to propose.
    """

    def propose(self, contexts: dict[str, list[int]], gamma: int) -> dict[str, DraftBlock]: ...

    def release(self, request_id: str) -> None: ...

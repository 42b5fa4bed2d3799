"""What the router needs from a verifier and a drafter tier.

The gRPC clients (`router/tiers/grpc.py`) implement the same two protocols, and so do the in-process
adapters at the bottom of each worker's `service.py` (`LocalVerifier`, `LocalDrafter`): the router core
runs unchanged over loopback gRPC, over remote replicas, or in one process (tests and the embedded mode).
Each call is one message of `services/calls.py`, passed on unchanged to the tier's service.
"""

from __future__ import annotations

from typing import Protocol

from services.calls import AheadCall, DraftCall, OpenCall, PrefillCall, Pushed, VerifyCall
from services.types import DraftBlock, Prefilled, Verified, VerifierProfile


class VerifierTier(Protocol):
    async def prefill(self, call: PrefillCall) -> Prefilled: ...

    async def verify(self, call: VerifyCall) -> Verified: ...

    async def release(self, request_id: str) -> None: ...

    def forget(self, request_id: str) -> None:
        """Cut this request's stream without a release (its replica is being given up on)."""

    async def profile(self) -> VerifierProfile: ...


class DrafterTier(Protocol):
    async def open(self, call: OpenCall) -> None: ...

    async def draft(self, call: DraftCall) -> DraftBlock: ...

    async def ahead(self, call: AheadCall) -> list[Pushed]:
        """Draft ahead for the cut of a block sent to verification → the blocks pushed, likeliest first."""

    async def release(self, request_id: str) -> None: ...

    def forget(self, request_id: str) -> None:
        """Cut this request's stream without a release (its replica is being given up on)."""

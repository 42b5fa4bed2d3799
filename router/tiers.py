"""What the router needs from a verifier and a drafter tier, and in-process adapters over the cores.

The gRPC clients (`router/grpc_tiers.py`) implement the same two protocols, so the router core runs
unchanged over loopback gRPC, over remote replicas, or in one process (tests and the embedded mode).
`traceparent` is the W3C context of the caller's span; in-process calls inherit it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from drafter_worker.service import DrafterService
from services.types import DraftBlock, SamplingParams
from verifier_worker.service import Prefilled, Verified, VerifierService


@dataclass(frozen=True, slots=True)
class VerifierProfile:
    engine_id: str  # the replica's key on the load board
    sps: list[tuple[int, float]] = field(default_factory=list)  # (batch tokens, step ms); empty: not profiled


class VerifierTier(Protocol):
    async def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      resume_ids: list[int], traceparent: str) -> Prefilled: ...

    async def verify(self, request_id: str, cycle: int, draft: DraftBlock | None, traceparent: str) -> Verified: ...

    async def release(self, request_id: str) -> None: ...

    async def profile(self) -> VerifierProfile: ...


class DrafterTier(Protocol):
    async def open(self, request_id: str, context_ids: list[int], features: torch.Tensor | None,
                   params: SamplingParams, cycle: int, method: str, traceparent: str) -> None: ...

    async def draft(self, request_id: str, cycle: int, new_ids: list[int], feature_start: int,
                    features: torch.Tensor | None, gamma: int, traceparent: str) -> DraftBlock: ...

    async def release(self, request_id: str) -> None: ...


class LocalVerifier:
    """A `VerifierService` in this process."""

    def __init__(self, service: VerifierService, profile: VerifierProfile | None = None):
        self.service, self._profile = service, profile or VerifierProfile("local")

    async def prefill(self, request_id, prompt_ids, params, resume_ids, traceparent) -> Prefilled:
        return await self.service.prefill(request_id, prompt_ids, params, resume_ids)

    async def verify(self, request_id, cycle, draft, traceparent) -> Verified:
        return await self.service.verify(request_id, cycle, draft)

    async def release(self, request_id) -> None:
        await self.service.release(request_id)

    def forget(self, request_id) -> None:
        """Nothing to cut: in process there is no stream (a pool calls this when it gives up on a replica)."""

    async def profile(self) -> VerifierProfile:
        return self._profile


class LocalDrafter:
    """A `DrafterService` in this process."""

    def __init__(self, service: DrafterService):
        self.service = service

    async def open(self, request_id, context_ids, features, params, cycle, method, traceparent) -> None:
        await self.service.open(request_id, context_ids, features, params, cycle, method)

    async def draft(self, request_id, cycle, new_ids, feature_start, features, gamma, traceparent) -> DraftBlock:
        return await self.service.draft(request_id, cycle, new_ids, feature_start, features, gamma)

    async def release(self, request_id) -> None:
        await self.service.release(request_id)

    def forget(self, request_id) -> None:
        """Nothing to cut: in process there is no stream."""

"""What the router needs from a verifier and a drafter tier.

The gRPC clients (`router/tiers/grpc.py`) implement the same two protocols, and so do the in-process
adapters at the bottom of each worker's `service.py` (`LocalVerifier`, `LocalDrafter`): the router core
runs unchanged over loopback gRPC, over remote replicas, or in one process (tests and the embedded mode).
`traceparent` is the W3C context of the caller's span; in-process calls inherit it directly.
"""

from __future__ import annotations

from typing import Protocol

import torch

from services.types import DraftBlock, PlainRun, Prefilled, SamplingParams, Verified, VerifierProfile


class VerifierTier(Protocol):
    async def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      resume_ids: list[int], traceparent: str, share_prefix_of: str = "",
                      plain: PlainRun | None = None) -> Prefilled:
        """`share_prefix_of`: a sibling sample's request id, whose cached prompt the replica may copy (a hint).
        `plain`: the request never carries a draft; the replica may decode ahead of the verify calls, each of
        which then takes the steps done since the last (services/types.py: PlainRun)."""

    async def verify(self, request_id: str, cycle: int, draft: DraftBlock | None, traceparent: str,
                     plain: PlainRun | None = None) -> Verified:
        """`plain` (no draft): from this cycle on the request runs ahead plainly on its verifier, for good."""

    async def release(self, request_id: str) -> None: ...

    def forget(self, request_id: str) -> None:
        """Cut this request's stream without a release (its replica is being given up on)."""

    async def profile(self) -> VerifierProfile: ...


class DrafterTier(Protocol):
    async def open(self, request_id: str, context_ids: list[int], features: torch.Tensor | None,
                   params: SamplingParams, cycle: int, method: str, traceparent: str) -> None: ...

    async def draft(self, request_id: str, cycle: int, new_ids: list[int], feature_start: int,
                    features: torch.Tensor | None, gamma: int, traceparent: str) -> DraftBlock: ...

    async def ahead(self, request_id: str, cycle: int, verify_len: int, accept: list[float] | None = None) -> None:
        """The block of `cycle` went to verification cut to `verify_len` drafts: draft ahead (no reply). `accept`:
        the router's ĉ_k of each verified draft, which the fan-out follows (None: the drafter's own estimate)."""

    async def release(self, request_id: str) -> None: ...

    def forget(self, request_id: str) -> None:
        """Cut this request's stream without a release (its replica is being given up on)."""

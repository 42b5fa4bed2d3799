"""Typed contracts between stages (docs/design.md §1 vocabulary)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import torch

from services.errors import InvalidRequestError


class OutcomeKind(StrEnum):
    """How the last emitted token of a cycle came about."""

    BONUS = "bonus"  # every verified draft was accepted; extra token from p_{ℓ+1}
    RECOVERED = "recovered"  # resampled from norm(max(0, p_j − q_j)) at the first rejection j
    FIRST = "first"  # sampled after prefill (the first anchor)


class FinishReason(StrEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 64

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class DraftBlock:
    """γ draft tokens from the anchor with their sparse truncated draft distributions q'_k.

    q_ids/q_probs None means q is one-hot at each token (greedy or deterministic drafters such as
    n-gram); otherwise row k is the support of q'_k and its probabilities (summing to 1).
    """

    tokens: list[int]  # [γ]
    q_ids: torch.Tensor | None = None  # [γ, K] int64
    q_probs: torch.Tensor | None = None  # [γ, K] fp32
    confidences: list[float] | None = None  # [γ] c_k, when the drafter has a confidence head
    # [γ] max_v q_k(v) of the draft distribution each token was drawn from (computed from x_<k only,
    # never from x_k): the acceptance signal of drafters without a confidence head
    peaks: list[float] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def head(self, length: int) -> DraftBlock:
        """The first `length` drafts (the verify length ℓ chosen by the scheduler)."""
        cut = slice(0, length)
        return DraftBlock(
            tokens=self.tokens[cut],
            q_ids=None if self.q_ids is None else self.q_ids[cut],
            q_probs=None if self.q_probs is None else self.q_probs[cut],
            confidences=None if self.confidences is None else self.confidences[cut],
            peaks=None if self.peaks is None else self.peaks[cut],
        )


@dataclass(slots=True)
class StepOutput:
    """What one engine step produced for one request."""

    request_id: str
    emitted: list[int]  # tokens newly committed as output: accepted drafts + recovered/bonus (or first)
    num_drafts: int = 0  # ℓ verified this step
    num_accepted: int = 0
    kind: OutcomeKind | None = None  # None for a prefill chunk that emits nothing yet
    feature_start: int = 0  # position of the first row of `features`
    features: torch.Tensor | None = None  # [P, num_taps * d] of the newly committed positions


# Results and loads that cross between the tiers and the router (what `protos/codec.py` encodes).
@dataclass(slots=True)
class Prefilled:
    """A verifier's answer to a prefill: the first token and the target features of the prompt."""


    emitted: list[int]  # [1] the first token; empty when resumed
    committed: int  # committed tokens: prompt + emitted (+ resumed)
    features: torch.Tensor | None  # [committed − 1, T*d] every position before the anchor


@dataclass(slots=True)
class Verified:
    output: StepOutput
    committed: int


@dataclass(slots=True)
class VerifierLoad:
    running: int
    waiting: int
    kv_used: int
    kv_total: int
    step_ms_ema: float
    steps: int
    streams: int
    batch_tokens: int  # tokens in the last step


@dataclass(slots=True)
class DrafterLoad:
    contexts: int
    queued: int
    step_ms_ema: float
    steps: int


@dataclass(frozen=True, slots=True)
class VerifierProfile:
    engine_id: str  # the replica's key on the load board
    sps: list[tuple[int, float]] = field(default_factory=list)  # (batch tokens, step ms); empty: not profiled


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

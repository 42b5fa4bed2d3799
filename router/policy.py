"""Verify-length policies: how many of a block's drafts (ℓ) go to the verifier this cycle.

Every policy here is non-anticipating: ℓ may depend on the block's length, the request's remaining
token budget and the confidences c_1..c_k (c_k is computed from x_{k−1}, before x_k is drawn), never
on the draft tokens themselves. That is what keeps speculative output distributed exactly as the
target's.
"""

from __future__ import annotations

from enum import StrEnum

from router.scheduler import survival
from services.types import DraftBlock


class Policy(StrEnum):
    NONE = "none"  # ℓ = 0: plain decoding, no drafter consulted
    FIXED = "fixed"  # ℓ = γ (or the block's length when shorter)
    MTP1 = "mtp1"  # ℓ = 1: the production MTP-1 baseline
    THRESHOLD = "threshold"  # ℓ = the longest prefix whose survival a_k = Π c_i stays ≥ λ


def max_verify_len(policy: Policy, gamma: int, remaining_tokens: int) -> int:
    """Upper bound on ℓ before drafting: a cycle emits at most ℓ + 1 tokens, so never draft past the budget."""
    if policy is Policy.NONE:
        return 0
    if policy is Policy.MTP1:
        gamma = 1
    return max(0, min(gamma, remaining_tokens - 1))


def verify_len(policy: Policy, block_len: int, bound: int) -> int:
    """ℓ for a drafted block of `block_len` tokens under the bound from `max_verify_len`."""
    if policy is Policy.NONE:
        return 0
    return min(block_len, bound)


def choose_verify_len(policy: Policy, block: DraftBlock, bound: int, threshold: float) -> int:
    """ℓ for a drafted block; THRESHOLD stops at the first position whose prefix survival drops below λ.

    A block without confidences (a drafter without a confidence head) is verified in full under THRESHOLD.
    """
    length = verify_len(policy, len(block), bound)
    if policy is not Policy.THRESHOLD or block.confidences is None:
        return length
    # a_{k+1} depends on x_1..x_k only, never on x_{k+1} itself
    return next((k for k, a in enumerate(survival(block.confidences[:length])) if a < threshold), length)

"""Verify-length policies: how many of a block's drafts (ℓ) go to the verifier this cycle.

Every policy here is non-anticipating: ℓ may depend on the block's length, the request's
remaining token budget and (later) confidences of earlier positions, never on the draft tokens
themselves. That is what keeps speculative output distributed exactly as the target's.
"""

from __future__ import annotations

from enum import StrEnum


class Policy(StrEnum):
    NONE = "none"  # ℓ = 0: plain decoding, no drafter consulted
    FIXED = "fixed"  # ℓ = γ (or the block's length when shorter)


def max_verify_len(policy: Policy, gamma: int, remaining_tokens: int) -> int:
    """Upper bound on ℓ before drafting: a cycle emits at most ℓ + 1 tokens, so never draft past the budget."""
    if policy is Policy.NONE:
        return 0
    return max(0, min(gamma, remaining_tokens - 1))


def verify_len(policy: Policy, block_len: int, bound: int) -> int:
    """ℓ for a drafted block of `block_len` tokens under the bound from `max_verify_len`."""
    if policy is Policy.NONE:
        return 0
    return min(block_len, bound)

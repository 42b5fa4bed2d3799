"""Verify-length policies: how many of a block's drafts (ℓ) go to the verifier this cycle.

Every policy here is non-anticipating: ℓ may depend on the block's length, the request's remaining
token budget and the acceptance estimates c_1..c_k (c_k is computed from x_{k−1}, before x_k is
drawn), never on the draft tokens themselves. That is what keeps speculative output distributed
exactly as the target's. `router/scheduling/planner.py` applies them.
"""

from __future__ import annotations

from enum import StrEnum


class Policy(StrEnum):
    NONE = "none"  # ℓ = 0: plain decoding, no drafter consulted
    FIXED = "fixed"  # ℓ = γ (or the block's length when shorter)
    MTP1 = "mtp1"  # ℓ = 1: the production MTP-1 baseline
    THRESHOLD = "threshold"  # ℓ = the longest prefix whose survival a_k = Π c_i stays ≥ λ
    DSPARK = "dspark"  # load-aware: λ(K) from the verifier's budget K (Algorithm 1, streaming form)


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

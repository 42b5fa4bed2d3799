"""Verify-length policies: how many of a block's drafts (ℓ) go to the verifier this cycle.

Every policy here is non-anticipating: ℓ may depend on the block's length, the request's remaining
token budget and the acceptance estimates c_1..c_k (c_k is computed from x_{k−1}, before x_k is
drawn), never on the draft tokens themselves. That is what keeps speculative output distributed
exactly as the target's. `VerifyPlanner.decide` (`router/scheduling/planner.py`) is the one place that
turns a policy into ℓ; `max_verify_len` only bounds how much is worth drafting.
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
    """Upper bound on ℓ, known before drafting: γ (1 for MTP-1), and never past the token budget, since a cycle
    emits at most ℓ + 1 tokens. 0: do not draft this cycle."""
    if policy is Policy.NONE:
        return 0
    if policy is Policy.MTP1:
        gamma = 1
    return max(0, min(gamma, remaining_tokens - 1))

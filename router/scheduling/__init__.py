"""Deciding verify lengths ℓ: policies, the SPS-profile budget, acceptance estimates, Algorithm 1 (reference)."""

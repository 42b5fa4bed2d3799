"""DSpark's Algorithm 1 in its batch form, as a pure function: the REFERENCE the tests hold the rule to
(docs/design.md §6). What the router runs is the streaming form, `router/scheduling/budget.py`, which plans
each verifier's budget from the previous blocks' survivals instead of waiting for every block of a step.

Vocabulary: R requests each hold a draft block with calibrated confidences c_{r,1..γ}; the survival
a_{r,j} = Π_{i≤j} c_{r,i} is the probability that draft j is accepted. Verifying ℓ_r drafts of request r
costs 1 + ℓ_r batch tokens (the anchor always goes); the step then emits 1 + Σ_{j≤ℓ_r} a_{r,j} tokens of r
in expectation. SPS(B) is the verifier's steps per second at B batch tokens, so the expected tokens per
second of the step is Θ = τ · SPS(B) with τ = Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j}).

Algorithm 1 admits (request, position) pairs in descending a_{r,j} (ties: smaller j first, then the
request order) and stops at the first pair that does not raise Θ. The early stop is what keeps the rule
lossless: the decision about draft x_{r,j} is taken before anything that depends on x_{r,j} (its own
c_{r,j+1}) could change it; a search that picks the best prefix in hindsight is biased.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence


def schedule(survivals: Mapping[str, Sequence[float]], sps: Callable[[int], float],
             other_tokens: int = 0) -> dict[str, int]:
    """Algorithm 1 → verify length ℓ_r per request.

    `survivals` maps each request to a_{r,1..γ_r}; `other_tokens` are batch tokens the step carries
    anyway (e.g. prefill chunks of other requests), which shift B without adding to τ.
    """
    lengths = dict.fromkeys(survivals, 0)
    order = {rid: n for n, rid in enumerate(survivals)}
    pairs = sorted(((a, j, rid) for rid, row in survivals.items() for j, a in enumerate(row, start=1) if a > 0),
                   key=lambda p: (-p[0], p[1], order[p[2]]))
    batch = len(survivals) + other_tokens
    tau = float(len(survivals))
    best = tau * sps(batch)
    for a, j, rid in pairs:
        if j != lengths[rid] + 1:  # a_{r,j} ≤ a_{r,j−1} keeps prefixes in order; equal values by the tie rule
            raise ValueError("survivals must be non-increasing per request (a_{r,j} = Π c_{r,i}, c ≤ 1)")
        theta = (tau + a) * sps(batch + 1)
        if theta <= best:
            break  # the first non-improvement ends the search (non-anticipating)
        lengths[rid], batch, tau, best = j, batch + 1, tau + a, theta
    return lengths

"""The streaming form of Algorithm 1: a per-verifier verify budget K and its threshold λ(K) (docs/design.md §6).

Blocks of different requests reach the router at different times, so Algorithm 1 never sees them
together. Instead, at most once per verifier step, a `VerifyBudget` plans from state that is older
than the blocks it will trim: the survivals of each active request's *previous* block, and the
verifier's other load (load board, or the router's own count when the board is stale). The plan is
a global search over the profiled SPS curve — K* = argmax_K Θ(K) with
Θ(K) = (R + R_o + Σ_{i≤K} a_(i)) / T(R + R_o + B_o + K), a_(i) the i-th largest survival, R_o the
other routers' requests at the verifier and B_o their tokens beyond one anchor each — and
λ(K*) = a_(K*). Each arriving block is trimmed to its leading drafts with a_j ≥ λ.

T(B) is the time of one cycle: 1 / SPS(B) plus the rest of a cycle as the router measures it (RPCs,
batching windows, its own work), and for K ≥ 1 what drafting adds on top. The paper's Θ = τ · SPS(B)
leaves the drafting cost out (its Limitations say so); with a drafter as costly as it is on this
machine (a third of a cycle), that Θ verifies long blocks that do not pay for their drafting. With
the cost in, K* = 0 means "drafting does not pay at this load": the requests then decode plainly
without asking the drafter, and one of them drafts now and then (a probe, at growing intervals) and
verifies its whole block, so the survivals the plan rests on stay current and the acceptance estimates
learn from its outcomes (a probe cut to nothing would teach them nothing: estimates that start low stayed
low, and served at c = 1 the policy decoded 90 % of its cycles plainly where fixed γ = 7 was faster).

Drafting off the critical path (`speculative.ahead`, docs/design.md §7): a draft answered from the drafter's
speculation cache costs a cycle almost nothing, so the drafting term is the expected one,
h · (a hit's extra) + (1 − h) · (a miss's extra), with h the hit rate of drafting cycles. The two extras and h
are kept apart rather than mixed in one EMA because h moves with the load (a busy drafter pre-drafts less) while
each extra stays put; with a high hit rate longer blocks cost little more than plain cycles and the plan says so.

Why this is lossless: the plan never sees the block it trims (a block is recorded only after it is
trimmed) and a_j depends on x_<j only, so whether x_j is verified never depends on x_j. Because the
plan's inputs are stale, the search needs no early stop; that is the paper's production form
(DeepSeek-V4 serving: capacity from confidences two steps old, then top-K by current survival).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from services.batching import ema


@dataclass(frozen=True, slots=True)
class VerifierView:
    """What the router knows of one verifier's load beyond its own requests."""

    other_requests: int = 0  # requests of other routers in the verifier's steps
    other_tokens: int = 0  # their tokens beyond one anchor each (drafts, prefill chunks)
    fallback: bool = True  # True: board stale or unavailable, only this router's requests are counted


@dataclass(frozen=True, slots=True)
class Plan:
    budget: int  # K: draft tokens the next verifier step should carry, over all requests
    threshold: float  # λ(K): an arriving block keeps its leading drafts with a_j ≥ λ
    batch_tokens: int  # planned B = anchors + other tokens + K
    fallback: bool
    planned_at: float  # monotonic seconds
    draft: bool = True  # False: drafting does not pay at this load (K* = 0), decode plainly

    @property
    def source(self) -> str:
        """Whose load the plan counted: "board" or "local" (this router's own requests)."""
        return "local" if self.fallback else "board"


def plan_budget(rows: Iterable[Sequence[float]], anchors: int, sps: Callable[[int], float],
                other_requests: int = 0, other_tokens: int = 0, draft_s: float = 0.0,
                extra_s: float = 0.0) -> tuple[int, float]:
    """(K*, λ(K*)) from survival rows a_{r,1..γ} of `anchors` requests (rows may be fewer: plain decoding).

    `draft_s` is the time drafting adds to a cycle, `extra_s` the rest of a cycle beyond the verifier's
    step; with both 0 this is Θ = τ · SPS(B). Ties in Θ keep the smaller K; λ is +inf when K* = 0.
    """
    pairs = sorted((a for row in rows for a in row if a > 0), reverse=True)
    base = anchors + other_requests + other_tokens
    tau = float(anchors + other_requests)
    best_k, best = 0, tau / (1 / sps(base) + extra_s)
    for k, a in enumerate(pairs, start=1):
        tau += a
        theta = tau / (1 / sps(base + k) + extra_s + draft_s)
        if theta > best:
            best_k, best = k, theta
    return best_k, (pairs[best_k - 1] if best_k else math.inf)


def leading(survivals: Sequence[float], threshold: float) -> int:
    """Leading drafts whose survival clears λ (survivals are non-increasing)."""
    return next((j for j, a in enumerate(survivals) if a < threshold), len(survivals))


def sla_len(survivals: Sequence[float], tokens_needed: float) -> int:
    """Smallest ℓ whose expected tokens 1 + Σ_{j≤ℓ} a_j reach `tokens_needed` (all of them if none does).

    Whether draft j is added depends on a_1..a_{j−1} only: non-anticipating like the threshold.
    """
    expected = 1.0
    for j, a in enumerate(survivals):
        if expected >= tokens_needed:
            return j
        expected += a
    return len(survivals)


class VerifyBudget:
    """The streaming scheduler of one verifier: plans K and λ(K), trims arriving blocks."""

    def __init__(self, sps: Callable[[int], float] | None = None, fallback_threshold: float = 0.3,
                 alpha: float = 0.2, probe_s: tuple[float, float] = (0.5, 8.0)):
        self.sps = sps  # None until the verifier's profile is known: the threshold policy meanwhile
        self.fallback_threshold = fallback_threshold
        self.rows: dict[str, tuple[float, ...]] = {}  # survivals of each active request's last block
        # The last block's survivals, kept when its request leaves: a request admitted while no other has a block
        # (at c = 1, every request) is planned from them rather than drafting its first block on faith.
        self.recent: tuple[float, ...] = ()
        self.alpha = alpha  # weight of the newest sample in the EMAs below
        self.step_s = 0.0  # verify round trip: how long a plan stays current
        self.plain_extra_s = 0.0  # a plain cycle's time beyond the profiled step
        self.draft_extra_s = 0.0  # a drafting cycle's time beyond the profiled step (drafted on the critical path)
        self.hit_extra_s = 0.0  # the same for a cycle whose draft came from the speculation cache
        self.hit_rate = 0.0  # share of drafting cycles answered from the cache (EMA)
        self.probe_s = probe_s  # (first, longest) interval between probes while drafting does not pay
        self._probe_every, self._probe_at = probe_s[0], 0.0
        self.plan: Plan | None = None

    def join(self, request_id: str) -> None:
        self.rows.setdefault(request_id, ())

    def leave(self, request_id: str) -> None:
        self.rows.pop(request_id, None)

    def observe_verify(self, seconds: float) -> None:
        self.step_s = ema(self.step_s, seconds, self.alpha)

    def observe_cycle(self, seconds: float, drafted: bool, hit: bool = False, verified: int = 0) -> None:
        """A whole cycle of a dspark request, drafted or plain, against the plan in force (replanned at most
        once a verify round trip, so close to the one the cycle ran under); `hit`: its draft came from the
        drafter's speculation cache; `verified`: its drafts sent (a probe's are beyond the plan's batch)."""
        if self.sps is None or self.plan is None:
            return
        batch = self.plan.batch_tokens + (0 if self.plan.draft else verified)
        extra = max(0.0, seconds - 1 / self.sps(batch))
        if not drafted:
            self.plain_extra_s = ema(self.plain_extra_s, extra, self.alpha)
            return
        self.hit_rate += self.alpha * (float(hit) - self.hit_rate)  # from 0: no hit seen means no hit expected
        if hit:
            self.hit_extra_s = ema(self.hit_extra_s, extra, self.alpha)
        else:
            self.draft_extra_s = ema(self.draft_extra_s, extra, self.alpha)

    @property
    def drafting_s(self) -> float:
        """What drafting adds to a cycle in expectation: only the share of it on the critical path."""
        expected = self.hit_rate * self.hit_extra_s + (1 - self.hit_rate) * self.draft_extra_s
        return max(0.0, expected - self.plain_extra_s)

    def wants_draft(self, view: VerifierView, now: float | None = None) -> bool:
        """Whether a request should draft this cycle: the plan says drafting pays, or a probe is due."""
        now = time.monotonic() if now is None else now
        if self.current(view, now).draft:
            self._probe_every = self.probe_s[0]
            return True
        if now < self._probe_at:
            return False
        self._probe_at = now + self._probe_every
        self._probe_every = min(2 * self._probe_every, self.probe_s[1])
        return True

    def current(self, view: VerifierView, now: float | None = None) -> Plan:
        """The plan in force, replanned when it is older than one verifier step."""
        now = time.monotonic() if now is None else now
        if self.plan is None or now - self.plan.planned_at >= self.step_s:
            self.plan = self._replan(view, now)
        return self.plan

    def trim(self, request_id: str, survivals: Sequence[float], view: VerifierView,
             tokens_needed: float = 0.0, now: float | None = None) -> tuple[int, Plan]:
        """ℓ for a block just arrived (its survivals, already capped by γ and the token budget), then
        record the block for later plans. `tokens_needed` (SLA) can only raise ℓ."""
        plan = self.current(view, now)
        if plan.draft:
            length = max(leading(survivals, plan.threshold), sla_len(survivals, tokens_needed) if tokens_needed else 0)
        else:  # a probe: verified whole, so that its outcomes keep the estimates current — a block cut to
            length = len(survivals)  # nothing teaches nothing, and estimates that are low would then stay low
        self.rows[request_id] = self.recent = tuple(survivals)
        return length, plan

    def _replan(self, view: VerifierView, now: float) -> Plan:
        anchors = max(len(self.rows), 1)
        rows = [row for row in self.rows.values() if row] or ([self.recent] if self.recent else [])
        if self.sps is None or not rows:  # no profile or no block seen yet: threshold policy
            pool = [a for row in self.rows.values() for a in row if a >= self.fallback_threshold]
            return Plan(len(pool), self.fallback_threshold, anchors + len(pool), view.fallback, now)
        k, lam = plan_budget(rows, anchors, self.sps, view.other_requests, view.other_tokens,
                             self.drafting_s, self.plain_extra_s)
        return Plan(k, lam, anchors + view.other_requests + view.other_tokens + k, view.fallback, now, draft=k > 0)

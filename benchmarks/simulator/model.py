"""The simulator's contracts: what a cluster costs, what an arm does, what load it sees, what comes out.

Everything is in seconds and tokens. The verifier's cost is its profiled step time
(`router.scheduling.sps.SpsCurve`, piecewise-linear in batch tokens B and extrapolated linearly past the
table), so a profile from any machine (this CPU's, or an illustrative GPU's) drops in; the rest of a cycle is a
few calibrated constants.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from router.scheduling.sps import SpsCurve

POLICIES = ("none", "mtp1", "fixed", "dspark")


@dataclass(slots=True)
class StepProfile:
    """Verifier step time vs batch tokens; `speed` > 1 makes every step proportionally faster."""

    curve: SpsCurve
    speed: float = 1.0

    def step_s(self, batch_tokens: int) -> float:
        return self.curve.ms(batch_tokens) / 1000.0 / self.speed

    def sps(self, batch_tokens: int) -> float:
        """Steps per second at B, the form `router.scheduling.budget.plan_budget` takes."""
        return 1.0 / self.step_s(batch_tokens)

    @classmethod
    def load(cls, path: Path, speed: float = 1.0) -> StepProfile:
        """A `dspark profile --json` file (points: [{batch_tokens, step_ms}]) or the same shape written by hand."""
        points = sorted(json.loads(Path(path).read_text())["points"], key=lambda p: p["batch_tokens"])
        curve = SpsCurve(tuple(int(p["batch_tokens"]) for p in points), tuple(float(p["step_ms"]) for p in points))
        return cls(curve, speed)


@dataclass(slots=True)
class DraftCost:
    """One drafter step drafts every queued request at once: base_s + per_request_s · n (n requests)."""

    base_s: float
    per_request_s: float = 0.0

    def step_s(self, requests: int) -> float:
        return self.base_s + self.per_request_s * requests


@dataclass(slots=True)
class CostModel:
    """Everything a cycle costs beyond the verifier's profiled step.

    A plain cycle is hop → verifier step → hop → router; a drafting cycle adds hop → drafter step → hop
    before it. `contention` slows a step that starts while its co-located other tier is busy (drafter d shares
    a host with verifier d mod N); 1.0 means dedicated hardware.
    """

    profile: StepProfile
    draft: dict[str, DraftCost]  # per drafting method
    hop_s: float = 0.0003  # one-way network delay, router ↔ tier
    router_s: float = 0.005  # router work per cycle (schedule, commit, stream a chunk)
    contention: float = 1.0  # ≥ 1: step-time factor when the co-located tier is busy at the step's start
    prefill_extra_s: float = 0.0  # per prefill in a step, beyond step(B): the profile's B = P point is many short
    # requests, one prompt's prefill costs differently (calibrated from TTFT at c = 1; may be negative)
    batch_window_s: float = 0.005  # tiers wait up to this for every session's work (serving `batch_window_ms`)
    gather_every_step: bool = False  # verifier gathers before every step, not only when idle (a what-if)
    # > 0: method none, and a dspark request whose plan says drafting does not pay (the router's hand-off), run
    # ahead on their verifier with one reply every this many steps (router plain_depth / stream_interval,
    # benchmarks/simulator/plain_run.py); 0: one exchange a token
    plain_run: int = 0

    def draft_cost(self, method: str) -> DraftCost:
        return self.draft.get(method) or self.draft["default"]


@dataclass(slots=True)
class Arm:
    """One serving arm: a policy, a drafting method and its per-position conditional acceptance c_k."""

    name: str
    policy: str  # one of POLICIES
    method: str = "none"  # key into CostModel.draft
    gamma: int = 0  # drafts per block
    accept: tuple[float, ...] = ()  # c_1..c_γ: P(draft k accepted | drafts < k accepted); last value repeats
    concentration: float = 4.0  # dspark: per-block c_k ~ Beta with mean c_k and this α + β
    probe_s: tuple[float, float] = (0.5, 8.0)  # dspark: probe interval while K* = 0 (first, longest)
    fallback_threshold: float = 0.3  # dspark: λ before any block has been seen (the router's threshold)
    ahead_hit: float = 0.0  # > 0: the drafter drafts ahead (speculation cache); P(hit | the pre-drafting finished)
    ahead_budget: int = 2  # outcomes pre-drafted per cycle: one drafter step each, run only while it is idle
    ahead_quality: float = 1.0  # c_k of a cached block as a share of a fresh one's (stand-in features)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}: {', '.join(POLICIES)}")

    def c(self, k: int) -> float:
        """c_k for position k ≥ 1 (0-based index k − 1), the last known value past the measured positions."""
        if not self.accept:
            return 0.0
        return self.accept[min(k, len(self.accept)) - 1]

    @property
    def bound(self) -> int:
        """Most drafts a cycle may verify under this policy (before the remaining-token cap)."""
        return {"none": 0, "mtp1": 1}.get(self.policy, self.gamma)


@dataclass(slots=True)
class SimWorkload:
    """Closed loop (`clients` > 0: each sends its next request when the last finished) or open-loop Poisson."""

    prompt_tokens: int = 64
    output_tokens: int = 64
    clients: int = 1  # closed loop; 0 → open loop at `rate`
    rate: float = 0.0  # requests per second, open loop
    requests: int = 16  # total requests of the run
    stagger_s: float = 0.0  # closed loop: clients start uniformly within this window (desynchronises them)


@dataclass(slots=True)
class Cluster:
    verifiers: int = 1  # N
    drafters: int = 1  # M
    drafter_gpu_share: float = 0.25  # GPUs one drafter replica occupies (for per-GPU throughput)

    @property
    def gpus(self) -> float:
        return self.verifiers + self.drafter_gpu_share * self.drafters


@dataclass(slots=True)
class RequestStats:
    sent_s: float
    ttft_s: float = 0.0  # since sent
    e2el_s: float = 0.0  # since sent
    output_tokens: int = 0
    cycles: int = 0

    @property
    def per_user_tok_s(self) -> float | None:
        decode = self.e2el_s - self.ttft_s
        return (self.output_tokens - 1) / decode if self.output_tokens > 1 and decode > 0 else None


@dataclass(slots=True)
class SimResult:
    """One simulated cell, with the bench's metric names where one exists."""

    arm: str
    verifiers: int
    drafters: int
    gpus: float
    load: float  # clients (closed) or rate (open)
    output_throughput: float  # tok/s over the run (first send → last completion), as `dspark bench` measures
    steady_throughput: float  # tok/s while every client is still busy (closed loop); = output_throughput otherwise
    per_user_tok_s_median: float
    ttft_ms_mean: float
    tpot_ms_mean: float
    tau: float  # tokens per verify cycle (decode cycles only)
    mean_verify_len: float  # drafts verified per cycle
    draft_fraction: float  # cycles that drafted
    mean_budget: float  # dspark: mean planned K* over plans (0 for the other policies)
    duration_s: float
    requests: int
    events: int
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def throughput_per_gpu(self) -> float:
        return self.steady_throughput / self.gpus

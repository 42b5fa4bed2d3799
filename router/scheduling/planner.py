"""The router's verify-length decisions: policy → ℓ for each arriving block, and learning from outcomes.

Per cycle: the block's signals become acceptance estimates ĉ_k (`router/scheduling/acceptance.py`), their
prefix products the survivals a_k; the policy turns them into ℓ — all of the block (`fixed`, `mtp1`),
the prefix with a_k ≥ λ (`threshold`), or the prefix with a_k ≥ λ(K) of the verifier's budget
(`dspark`, `router/scheduling/budget.py`), which may also say that drafting does not pay at the current load. A
per-request SLA can only lengthen ℓ. Outcomes recalibrate the estimates; round trips time the cycle
the budget plans for. With a pool of verifier replicas each replica has its own budget, over the
requests placed on it (`engine_of`: request → the replica's board key), and a request that moves to
another replica moves budgets. No Ray, no gRPC, no Redis.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from router.scheduling.acceptance import AcceptanceModel
from router.scheduling.board_view import BoardView
from router.scheduling.budget import Plan, VerifierView, VerifyBudget, leading, sla_len
from router.scheduling.policy import Policy
from router.scheduling.sps import SpsCurve, survival
from services.types import DraftBlock


@dataclass(frozen=True, slots=True)
class CycleRecord:
    """What one finished cycle teaches the planner: its timing for the budget, its outcome for the estimates."""

    request_id: str
    policy: Policy
    method: str
    greedy: bool
    decision: Decision | None  # None: the cycle verified no drafts the planner scheduled
    verified: int  # ℓ the verifier saw
    accepted: int
    verify_s: float  # the verify round trip
    cycle_s: float  # the whole cycle, drafting included
    hit: bool = False  # the block came from the drafter's speculation cache (drafted off the critical path)


@dataclass(slots=True)
class Decision:
    verify_len: int  # ℓ
    drafted: int  # block length before trimming (already capped by γ and the token budget)
    signals: list[float | None]  # [drafted] what the drafter sent for each position
    accept: list[float]  # [drafted] ĉ_k: the acceptance estimates of each position
    plan: Plan | None  # the budget in force (policy dspark)

    @property
    def survivals(self) -> list[float]:
        """[drafted] a_k = Π_{i≤k} ĉ_i."""
        return survival(self.accept)


class VerifyPlanner:
    def __init__(self, threshold: float = 0.3, board: BoardView | None = None,
                 engine_of: Callable[[str], str | None] | None = None, explore: int = 0):
        self.threshold = threshold  # λ of policy threshold, and of dspark until the SPS profile is known
        # Cold start: threshold and dspark verify whole blocks until `explore` cycles have verified drafts. A
        # cut block teaches the estimates nothing past its cut, so estimates that start low (a head trained at
        # another temperature) would otherwise stay low. Depends on past outcomes only: non-anticipating.
        self.explore, self._explored = explore, 0
        self.board = board
        self.engine_id = ""  # the profiled verifier's key on the load board (the default replica)
        self.engine_of = engine_of  # request → its replica's board key (None: not placed right now)
        self.acceptance = AcceptanceModel()
        self.sps: SpsCurve | None = None  # one profile: the replicas of a pool share model and hardware
        self._budgets: dict[str, VerifyBudget] = {}
        self._engine: dict[str, str] = {}  # request → the replica whose budget counts it

    def set_profile(self, engine_id: str, points: list[tuple[int, float]]) -> None:
        """The verifier's identity and SPS(B) table (from its Profile RPC); without one dspark uses λ."""
        self.engine_id = engine_id
        if len(points) >= 2:
            batch, ms = zip(*sorted(points), strict=True)
            self.sps = SpsCurve(tuple(batch), tuple(ms))
            for budget in self._budgets.values():
                budget.sps = self.sps

    def budget(self, request_id: str) -> tuple[str, VerifyBudget]:
        """The replica this request is verified on and its budget (joining it there if it moved)."""
        old = self._engine.get(request_id)
        engine = (self.engine_of(request_id) if self.engine_of else None) or old or self.engine_id
        budget = self._budgets.get(engine)
        if budget is None:
            budget = self._budgets[engine] = VerifyBudget(self.sps, fallback_threshold=self.threshold)
        if engine != old:
            if old is not None:
                self._budgets[old].leave(request_id)
            budget.join(request_id)
            self._engine[request_id] = engine
        return engine, budget

    def view(self, engine: str, budget: VerifyBudget) -> VerifierView:
        if self.board is None or not engine:
            return VerifierView()
        return self.board.view(engine, len(budget.rows))

    def join(self, request_id: str) -> None:
        self.budget(request_id)

    def leave(self, request_id: str) -> None:
        engine = self._engine.pop(request_id, None)
        if engine is not None:
            self._budgets[engine].leave(request_id)

    def wants_draft(self, request_id: str, policy: Policy, sla: float) -> bool:
        """Whether a request asks the drafter this cycle; only dspark skips, never under an SLA."""
        if policy is not Policy.DSPARK or sla > 0 or self._explored < self.explore:
            return True
        engine, budget = self.budget(request_id)
        return budget.wants_draft(self.view(engine, budget))

    def source(self, request_id: str) -> str:
        """Which load the plan in force for this request's replica counted (board | local)."""
        plan = self.budget(request_id)[1].plan
        return "local" if plan is None else plan.source

    def observe(self, cycle: CycleRecord) -> None:
        """One call per cycle: round-trip and cycle times to the replica's budget, the outcome to the estimates."""
        budget = self.budget(cycle.request_id)[1]
        budget.observe_verify(cycle.verify_s)
        self._explored += cycle.decision is not None and cycle.verified > 0
        if cycle.decision is not None:
            self.acceptance.observe(cycle.method, cycle.greedy, cycle.decision.signals, cycle.verified, cycle.accepted)
        if cycle.policy is Policy.DSPARK:
            budget.observe_cycle(cycle.cycle_s, drafted=cycle.decision is not None, hit=cycle.hit,
                                 verified=cycle.verified)

    def decide(self, request_id: str, policy: Policy, method: str, greedy: bool, block: DraftBlock, bound: int,
               tokens_needed: float = 0.0) -> Decision:
        """ℓ, decided here and nowhere else. The rule: of the block's first `bound` drafts (bound =
        `max_verify_len`: γ and the token budget), verify all (fixed, mtp1), none (none), the longest prefix whose
        survival a_k = Π ĉ_i stays ≥ λ (threshold), or the prefix the verifier's budget buys at its load (dspark);
        an SLA (`tokens_needed` tokens per cycle) can only lengthen the last two. Non-anticipating: ℓ depends on
        the confidences, never on the draft tokens themselves. (The verifier's engine only guards its KV room.)"""
        if policy is Policy.NONE:
            bound = 0
        block = block.head(min(len(block), bound))
        signals = AcceptanceModel.signals(block)
        accept = self.acceptance.estimate(method, greedy, signals)
        a = survival(accept)
        length, plan = len(block), None
        if policy is Policy.THRESHOLD:
            length = max(leading(a, self.threshold), sla_len(a, tokens_needed) if tokens_needed else 0)
        elif policy is Policy.DSPARK:
            engine, budget = self.budget(request_id)
            length, plan = budget.trim(request_id, a, self.view(engine, budget), tokens_needed)
        if policy in (Policy.THRESHOLD, Policy.DSPARK) and self._explored < self.explore:
            length = len(block)
        return Decision(length, len(block), signals, list(accept), plan)

"""The router's verify-length decisions: policy → ℓ for each arriving block, and learning from outcomes.

Per cycle: the block's signals become acceptance estimates ĉ_k (`router/acceptance.py`), their
prefix products the survivals a_k; the policy turns them into ℓ — all of the block (`fixed`, `mtp1`),
the prefix with a_k ≥ λ (`threshold`), or the prefix with a_k ≥ λ(K) of the verifier's budget
(`dspark`, `router/budget.py`), which may also say that drafting does not pay at the current load. A
per-request SLA can only lengthen ℓ. Outcomes recalibrate the estimates; round trips time the cycle
the budget plans for. No Ray, no gRPC, no Redis.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.acceptance import AcceptanceModel
from router.board_view import BoardView
from router.budget import Plan, VerifierView, VerifyBudget, leading, sla_len
from router.policy import Policy
from router.scheduler import SpsCurve, survival
from services.types import DraftBlock


@dataclass(slots=True)
class Decision:
    verify_len: int  # ℓ
    drafted: int  # block length before trimming (already capped by γ and the token budget)
    signals: list[float | None]  # [drafted] what the drafter sent for each position
    survivals: list[float]  # [drafted] a_1..a_drafted from the acceptance estimates
    plan: Plan | None  # the budget in force (policy dspark)


class VerifyPlanner:
    def __init__(self, threshold: float = 0.3, board: BoardView | None = None):
        self.threshold = threshold  # λ of policy threshold, and of dspark until the SPS profile is known
        self.board = board
        self.engine_id = ""  # the verifier's key on the load board
        self.acceptance = AcceptanceModel()
        self.budget = VerifyBudget(fallback_threshold=threshold)

    def set_profile(self, engine_id: str, points: list[tuple[int, float]]) -> None:
        """The verifier's identity and SPS(B) table (from its Profile RPC); without one dspark uses λ."""
        self.engine_id = engine_id
        if len(points) >= 2:
            batch, ms = zip(*sorted(points), strict=True)
            self.budget.sps = SpsCurve(tuple(batch), tuple(ms))

    def view(self) -> VerifierView:
        if self.board is None or not self.engine_id:
            return VerifierView()
        return self.board.view(self.engine_id, len(self.budget.rows))

    def join(self, request_id: str) -> None:
        self.budget.join(request_id)

    def leave(self, request_id: str) -> None:
        self.budget.leave(request_id)

    def wants_draft(self, policy: Policy, sla: float) -> bool:
        """Whether a request asks the drafter this cycle; only dspark skips, never under an SLA."""
        return policy is not Policy.DSPARK or sla > 0 or self.budget.wants_draft(self.view())

    def observe_verify(self, seconds: float) -> None:
        self.budget.observe_verify(seconds)

    def observe_cycle(self, seconds: float, policy: Policy, drafted: bool) -> None:
        if policy is Policy.DSPARK:
            self.budget.observe_cycle(seconds, drafted)

    def decide(self, request_id: str, policy: Policy, method: str, greedy: bool, block: DraftBlock,
               tokens_needed: float = 0.0) -> Decision:
        """ℓ for a block already capped by γ and the token budget; `tokens_needed` = SLA tokens per cycle."""
        signals = AcceptanceModel.signals(block)
        a = survival(self.acceptance.estimate(method, greedy, signals))
        length, plan = len(block), None
        if policy is Policy.THRESHOLD:
            length = max(leading(a, self.threshold), sla_len(a, tokens_needed) if tokens_needed else 0)
        elif policy is Policy.DSPARK:
            length, plan = self.budget.trim(request_id, a, self.view(), tokens_needed)
        return Decision(length, len(block), signals, a, plan)

    def learn(self, method: str, greedy: bool, decision: Decision, verified: int, accepted: int) -> None:
        self.acceptance.observe(method, greedy, decision.signals, verified, accepted)

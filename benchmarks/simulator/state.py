"""The simulator's state of a replica and of a request (what `engine.py` and its mixins, `ahead.py` and
`plain_run.py`, all read: here, so none of them imports another's module for it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.simulator.model import RequestStats
from benchmarks.simulator.policies import Block, SimBudget


@dataclass(slots=True)
class SimReplica:
    queue: list = field(default_factory=list)  # verifier: (rid, tokens, ℓ); drafter: rid
    busy: bool = False
    active: int = 0  # requests placed here and not finished
    sessions: set = field(default_factory=set)  # verifier: prefilled requests; drafter: opened contexts
    queued_sessions: int = 0  # queue items of `sessions` (the batch window waits for all of them)
    window: int = 0  # batch-window generation: a timer of an older one is stale
    budget: SimBudget | None = None  # verifiers of the dspark policy
    ahead: list = field(default_factory=list)  # drafter: [rid, steps left] pre-drafting jobs, oldest first


@dataclass(slots=True)
class Req:
    rid: int
    client: int
    verifier: int
    drafter: int
    remaining: int  # output tokens still to emit
    stats: RequestStats
    cycle_at: float = 0.0  # when the current cycle began
    verify_at: float = 0.0  # when the current verify was sent
    block: Block | None = None
    drafted: bool = False
    ahead_ready: bool = False  # its pre-drafting job finished since the last draft
    hit: bool = False  # this cycle's block came from the speculation cache
    run: bool = False  # decoded by a plain run on its verifier from now on (plain_run.py)
    run_left: int = 0  # tokens the run still has to step
    run_done: int = 0  # steps done since its last reply

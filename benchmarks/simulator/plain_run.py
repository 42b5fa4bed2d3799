"""Plain runs in the simulator (`verifier_worker/plain_run.py`, docs/design.md §5): a request decoded plainly
(method none, or a dspark request the router handed off because its plan said drafting does not pay) has its
next step queued by the verifier as soon as the last one is done, and a reply — one hop, one router turn —
carries every `CostModel.plain_run` steps (fewer at the end). The router's work and the hops then overlap the
verifier's steps instead of adding to them. The real run is bounded by `plain_depth` steps before the router asks;
the model leaves the bound out (with replies every few steps the router keeps up)."""

from __future__ import annotations


class PlainRuns:
    """Mixed into `Simulation`: starts runs and handles their steps."""

    def runs_plainly(self) -> bool:
        """Whether a request about to decode without drafts does so as a plain run (the same for all of an arm)."""
        return self.cost.plain_run > 0 and self.arm.policy in ("none", "dspark")

    def start_run(self, req) -> None:
        req.run, req.run_left, req.run_done = True, req.remaining, 0
        self._send_verify(req, 0)

    def run_step(self, rep, rid: int, step: float) -> None:
        """A run's step is done: a reply every `plain_run` steps or at its end; its next step queued at once."""
        req = self.reqs[rid]
        req.run_left -= 1
        req.run_done += 1
        if req.run_done >= self.cost.plain_run or req.run_left <= 0:
            self.tally.verified(0)
            self.at(self.now + self.cost.hop_s, self.commit, rid, req.run_done, step, False)
            req.run_done = 0
        if req.run_left > 0:
            rep.queue.append((rid, 1, 0))
            rep.queued_sessions += 1

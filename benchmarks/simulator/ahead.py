"""The speculation cache in simulated time: pre-drafting jobs on the drafter replicas, hits at the next draft.

A mixin of `benchmarks.simulator.engine.Simulation` (it uses the simulation's clock, replicas and requests), kept
apart because only arms with `ahead_hit` > 0 reach it. The model: the verify notice gives the request's drafter a
job of `ahead_budget` drafter steps (one per pre-drafted outcome), run one step at a time while that drafter has
nothing queued; a real draft waits for the step in progress (the per-piece lock of `drafter_worker/ahead.py`) and
ends the job. A draft request whose job had finished is a hit with probability `ahead_hit` (the measured share of
outcomes the cache covers) and returns after its hops alone.
"""

from __future__ import annotations

from benchmarks.simulator.state import Req, SimReplica


class AheadDrafting:
    def _cache_hit(self, rep: SimReplica, req: Req) -> bool:
        """Whether this draft request is answered from the cache; either way the request's job ends here."""
        if self.arm.ahead_hit <= 0:
            return False
        ready, req.ahead_ready = req.ahead_ready, False
        rep.ahead = [job for job in rep.ahead if job[0] != req.rid]
        hit = ready and self.rng.random() < self.arm.ahead_hit
        self.tally.cache(hit)
        return hit

    def ahead_notice(self, d: int, rid: int) -> None:
        rep = self.drafters[d]
        rep.ahead.append([rid, self.arm.ahead_budget])
        self._ahead_step(d)

    def _ahead_step(self, d: int) -> None:
        """One step of the oldest pre-drafting job, only while the drafter has nothing else to do."""
        rep = self.drafters[d]
        if rep.busy or rep.queue or not rep.ahead:
            return
        rep.busy = True
        step = self.draft_cost.step_s(1)
        if self.cost.contention != 1.0 and self.verifiers[d % len(self.verifiers)].busy:
            step *= self.cost.contention
        self.at(self.now + step, self.ahead_done, d, rep.ahead[0])

    def ahead_done(self, d: int, job: list) -> None:
        rep = self.drafters[d]
        rep.busy = False
        job[1] -= 1
        if job[1] <= 0 and any(j is job for j in rep.ahead):  # finished, and not ended by a draft meanwhile
            rep.ahead = [j for j in rep.ahead if j is not job]
            if job[0] in self.reqs:
                self.reqs[job[0]].ahead_ready = True
        if rep.queue:
            self._gather(rep, d, self._drafter_step)
        else:
            self._ahead_step(d)

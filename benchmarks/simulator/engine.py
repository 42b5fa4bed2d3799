"""The discrete-event model: clients → router → drafter pool → verifier pool, in simulated seconds.

One heap of (time, seq, handler, args) events. Each request runs the router's cycle — draft → schedule → verify
→ commit — against replicas that batch: a verifier step takes every ready item (1 + ℓ tokens, or a prefill of
P tokens) and lasts step_time(B); a drafter step drafts every queued request at once. Placement is least-loaded
at arrival and sticky. Every hop costs `hop_s` one way and every cycle `router_s` of router work.

An arm with `ahead_hit` > 0 drafts ahead (docs/design.md §7): the verify notice gives the request's drafter a job
of `ahead_budget` drafter steps, run one step at a time while the drafter has nothing queued (a real draft waits
for the step in progress, as `drafter_worker/ahead.py` does); when the request's next draft arrives after its job
finished, it is a hit with probability `ahead_hit` and returns without a drafter step.
"""

from __future__ import annotations

import heapq
import random
import statistics
import time

from benchmarks.simulator.ahead import AheadDrafting
from benchmarks.simulator.metrics import Tally, result
from benchmarks.simulator.model import Arm, Cluster, CostModel, RequestStats, SimResult, SimWorkload
from benchmarks.simulator.plain_run import PlainRuns
from benchmarks.simulator.policies import OWN_LOAD, SimBudget, accepted, draw_block, verify_len
from benchmarks.simulator.state import Req, SimReplica


class Simulation(AheadDrafting, PlainRuns):
    """One run of one arm on one cluster under one workload; `run()` → `SimResult`."""

    def __init__(self, arm: Arm, cost: CostModel, cluster: Cluster, workload: SimWorkload, seed: int = 0):
        self.arm, self.cost, self.cluster, self.work = arm, cost, cluster, workload
        self.rng = random.Random(seed)
        self.draft_cost = cost.draft_cost(arm.method) if arm.policy != "none" else None
        self.verifiers = [SimReplica(budget=self._budget()) for _ in range(cluster.verifiers)]
        self.drafters = [SimReplica() for _ in range(cluster.drafters)]
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.reqs: dict[int, Req] = {}
        self.sent = 0
        self.tally = Tally()

    def _budget(self) -> SimBudget | None:
        if self.arm.policy != "dspark":
            return None
        return SimBudget(self.cost.profile, self.arm.fallback_threshold, self.arm.probe_s)

    # --- event queue ------------------------------------------------------------------------------------------
    def at(self, t: float, handler, *args) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, handler, args))

    def run(self) -> SimResult:
        started = time.perf_counter()
        self._start_load()
        events = 0
        while self.heap:
            self.now, _, handler, args = heapq.heappop(self.heap)
            handler(*args)
            events += 1
        budgets = [v.budget for v in self.verifiers if v.budget is not None]
        mean_budget = statistics.fmean(b.budget_sum / b.plans for b in budgets if b.plans) if budgets else 0.0
        return result(self.arm.name, self.cluster, self.work, self.tally, mean_budget, events,
                      time.perf_counter() - started)

    def _start_load(self) -> None:
        w = self.work
        if w.clients > 0:
            for c in range(min(w.clients, w.requests)):
                self.at(self.rng.uniform(0, w.stagger_s) if w.stagger_s else 0.0, self.send, c)
            if w.stagger_s:
                self.at(w.stagger_s, self.tally.window_start, self)
            return
        t = 0.0
        for c in range(w.requests):
            t += self.rng.expovariate(w.rate)
            self.at(t, self.send, c)

    # --- router ----------------------------------------------------------------------------------------------
    def send(self, client: int) -> None:
        """A client's request reaches the router: place it and send its prefill."""
        self.sent += 1
        v = min(range(len(self.verifiers)), key=lambda i: self.verifiers[i].active)
        d = min(range(len(self.drafters)), key=lambda i: self.drafters[i].active) if self.drafters else -1
        rid = self.sent
        req = Req(rid, client, v, d, self.work.output_tokens, RequestStats(self.now))
        self.reqs[rid] = req
        self.verifiers[v].active += 1
        if d >= 0 and self.draft_cost is not None:
            self.drafters[d].active += 1
        if self.verifiers[v].budget is not None:
            self.verifiers[v].budget.join(rid)
        self.at(self.now + self.cost.hop_s, self.verifier_enqueue, v, (rid, self.work.prompt_tokens, -1))

    def begin_cycle(self, rid: int) -> None:
        req = self.reqs[rid]
        req.cycle_at = self.now
        bound = min(self.arm.bound, req.remaining - 1)
        budget = self.verifiers[req.verifier].budget
        req.drafted = bound > 0 and req.drafter >= 0 and (budget is None or budget.wants_draft(OWN_LOAD, self.now))
        if req.drafted:
            self.at(self.now + self.cost.hop_s, self.drafter_enqueue, req.drafter, rid)
        elif self.runs_plainly():
            self.start_run(req)
        else:
            self._send_verify(req, 0)

    def drafted(self, rid: int) -> None:
        """The block is back at the router: schedule (trim) it and send it for verification."""
        req = self.reqs[rid]
        bound = min(self.arm.bound, req.remaining - 1)
        req.block = draw_block(self.arm, bound, self.rng, self.arm.ahead_quality if req.hit else 1.0)
        length = verify_len(self.arm, bound, req.block, self.verifiers[req.verifier].budget, rid, self.now)
        self._send_verify(req, length)

    def _send_verify(self, req: Req, length: int) -> None:
        req.verify_at = self.now + self.cost.hop_s
        if self.arm.ahead_hit > 0 and length > 0:  # the ahead notice, beside the verify call
            self.at(req.verify_at, self.ahead_notice, req.drafter, req.rid)
        self.at(req.verify_at, self.verifier_enqueue, req.verifier, (req.rid, 1 + length, length))

    def commit(self, rid: int, emitted: int, step_s: float, prefill: bool) -> None:
        """Tokens reach the router: stream them, finish the request or start its next cycle."""
        req = self.reqs[rid]
        emitted = min(emitted, req.remaining)
        req.remaining -= emitted
        req.stats.output_tokens += emitted
        self.tally.tokens += emitted
        budget = self.verifiers[req.verifier].budget
        if prefill:
            req.stats.ttft_s = self.now - req.stats.sent_s
        else:
            req.stats.cycles += 1
            self.tally.cycle(emitted, step_s, req.drafted)
            if budget is not None and not req.run:
                budget.observe_verify(self.now - req.verify_at)
                budget.observe_cycle(self.now + self.cost.router_s - req.cycle_at, req.drafted, req.hit)
        if req.remaining > 0:
            if not req.run:  # a run's verifier steps on by itself
                self.at(self.now + self.cost.router_s, self.begin_cycle, rid)
            return
        self._finish(req)

    def _finish(self, req: Req) -> None:
        req.stats.e2el_s = self.now - req.stats.sent_s
        self.tally.done(req.stats, self)
        self.verifiers[req.verifier].active -= 1
        self.verifiers[req.verifier].sessions.discard(req.rid)
        if req.drafter >= 0 and self.draft_cost is not None:
            self.drafters[req.drafter].active -= 1
            self.drafters[req.drafter].sessions.discard(req.rid)
        if self.verifiers[req.verifier].budget is not None:
            self.verifiers[req.verifier].budget.leave(req.rid)
        del self.reqs[req.rid]
        if self.work.clients > 0:
            if self.sent < self.work.requests:
                self.send(req.client)
            else:
                self.tally.window_end(self)

    # --- verifier replicas ------------------------------------------------------------------------------------
    def verifier_enqueue(self, v: int, item: tuple) -> None:
        rep = self.verifiers[v]
        rep.queue.append(item)
        rep.queued_sessions += item[2] >= 0
        if not rep.busy:
            self._gather(rep, v, self._verifier_step)

    def _gather(self, rep: SimReplica, index: int, step) -> None:
        """The tiers' batch window: start once every session has work queued, else when the window closes
        (`services.batching.gather_window`), so concurrent requests share steps instead of desynchronising."""
        if rep.queued_sessions >= len(rep.sessions) or self.cost.batch_window_s <= 0:
            step(index)
        elif rep.window >= 0:
            rep.window = -rep.window - 1  # armed (negative) until the timer fires or a step starts
            self.at(self.now + self.cost.batch_window_s, self.window_closed, rep, index, step, rep.window)

    def window_closed(self, rep: SimReplica, index: int, step, window: int) -> None:
        if rep.window == window and not rep.busy and rep.queue:
            step(index)

    def _take(self, rep: SimReplica) -> list:
        batch, rep.queue, rep.busy, rep.queued_sessions = rep.queue, [], True, 0
        rep.window = abs(rep.window) + 1
        return batch

    def _verifier_step(self, v: int) -> None:
        rep = self.verifiers[v]
        batch = self._take(rep)
        tokens = sum(item[1] for item in batch)  # B
        prefills = sum(item[2] < 0 for item in batch)
        step = self.cost.profile.step_s(tokens)
        step = max(step + prefills * self.cost.prefill_extra_s, 0.5 * step)
        if self.cost.contention != 1.0 and self._drafter_busy(v):
            step *= self.cost.contention
        self.at(self.now + step, self.verifier_done, v, batch, step)

    def verifier_done(self, v: int, batch: list, step: float) -> None:
        rep = self.verifiers[v]
        rep.busy = False
        for rid, _tokens, length in batch:
            if length < 0:
                emitted = 1  # the prefill emits the first token
                rep.sessions.add(rid)
            elif self.reqs[rid].run:
                self.run_step(rep, rid, step)
                continue
            else:
                req = self.reqs[rid]
                emitted = 1 + (accepted(req.block, length, self.rng) if length else 0)
                self.tally.verified(length)
            self.at(self.now + self.cost.hop_s, self.commit, rid, emitted, step, length < 0)
        if rep.queue:  # the verifier's loop steps again at once (`verifier_worker/service.py`), unless told to gather
            if self.cost.gather_every_step:
                self._gather(rep, v, self._verifier_step)
            else:
                self._verifier_step(v)

    # --- drafter replicas -------------------------------------------------------------------------------------
    def drafter_enqueue(self, d: int, rid: int) -> None:
        rep = self.drafters[d]
        req = self.reqs[rid]
        req.hit = self._cache_hit(rep, req)
        if req.hit:  # answered from the cache: no drafter step
            self.at(self.now + self.cost.hop_s, self.drafted, rid)
            return
        rep.queue.append(rid)
        rep.sessions.add(rid)  # a context opens at the request's first draft
        rep.queued_sessions += 1
        if not rep.busy:
            self._gather(rep, d, self._drafter_step)

    def _drafter_step(self, d: int) -> None:
        rep = self.drafters[d]
        batch = self._take(rep)
        step = self.draft_cost.step_s(len(batch))
        if self.cost.contention != 1.0 and self.verifiers[d % len(self.verifiers)].busy:
            step *= self.cost.contention
        self.at(self.now + step, self.drafter_done, d, batch)

    def drafter_done(self, d: int, batch: list) -> None:
        rep = self.drafters[d]
        rep.busy = False
        for rid in batch:
            self.at(self.now + self.cost.hop_s, self.drafted, rid)
        if rep.queue:  # the drafter's loop gathers again before every step
            self._gather(rep, d, self._drafter_step)
        else:
            self._ahead_step(d)

    def _drafter_busy(self, v: int) -> bool:
        n = len(self.verifiers)
        return any(self.drafters[d].busy for d in range(v, len(self.drafters), n))


def simulate(arm: Arm, cost: CostModel, cluster: Cluster, workload: SimWorkload, seed: int = 0) -> SimResult:
    return Simulation(arm, cost, cluster, workload, seed).run()

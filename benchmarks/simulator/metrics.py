"""Counters a run keeps and their reduction to a `SimResult`, with the bench's definitions (vLLM `bench serve`).

Output throughput is tokens over first send → last completion, as `dspark bench` measures a cell. Closed-loop
runs also report a steady-state throughput: tokens committed while every client was still busy (from the end of
the start-up stagger to the first client running out of requests), free of the start-up burst and the tail.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from benchmarks.simulator.model import Cluster, RequestStats, SimResult, SimWorkload


@dataclass(slots=True)
class Tally:
    tokens: int = 0  # output tokens committed so far
    cycles: int = 0  # decode cycles
    cycle_tokens: int = 0  # tokens emitted by decode cycles
    drafted_cycles: int = 0
    verified_drafts: int = 0  # Σ ℓ over decode cycles
    cache_hits: int = 0  # draft requests answered from the speculation cache (arms that draft ahead)
    cache_misses: int = 0
    done_stats: list[RequestStats] = field(default_factory=list)
    last_done_s: float = 0.0
    window: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) at window start and end

    def cycle(self, emitted: int, _step_s: float, drafted: bool) -> None:
        self.cycles += 1
        self.cycle_tokens += emitted
        self.drafted_cycles += drafted

    def cache(self, hit: bool) -> None:
        self.cache_hits += hit
        self.cache_misses += not hit

    def verified(self, length: int) -> None:
        self.verified_drafts += length

    def done(self, stats: RequestStats, sim) -> None:
        self.done_stats.append(stats)
        self.last_done_s = sim.now

    def window_start(self, sim) -> None:
        if not self.window:
            self.window.append((sim.now, self.tokens))

    def window_end(self, sim) -> None:
        """The first client without a next request: from here on the load falls, so the steady window ends."""
        if len(self.window) == 1:
            self.window.append((sim.now, self.tokens))
        elif not self.window:  # no stagger: the window starts at 0
            self.window.extend([(0.0, 0), (sim.now, self.tokens)])

    def steady(self) -> float | None:
        if len(self.window) == 2 and self.window[1][0] > self.window[0][0]:
            (t0, n0), (t1, n1) = self.window
            return (n1 - n0) / (t1 - t0)
        return None


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def result(arm: str, cluster: Cluster, work: SimWorkload, tally: Tally, mean_budget: float, events: int,
           wall_s: float) -> SimResult:
    stats = tally.done_stats
    first = min((s.sent_s for s in stats), default=0.0)
    duration = tally.last_done_s - first
    output = sum(s.output_tokens for s in stats)
    throughput = output / duration if duration > 0 else float("nan")
    speeds = [v for v in (s.per_user_tok_s for s in stats) if v is not None]
    tpots = [(s.e2el_s - s.ttft_s) / (s.output_tokens - 1) for s in stats if s.output_tokens > 1]
    steady = tally.steady() if work.clients > 0 else None
    return SimResult(
        arm=arm, verifiers=cluster.verifiers, drafters=cluster.drafters, gpus=cluster.gpus,
        load=float(work.clients or work.rate), output_throughput=throughput,
        steady_throughput=steady if steady is not None else throughput,
        per_user_tok_s_median=statistics.median(speeds) if speeds else float("nan"),
        ttft_ms_mean=_mean([s.ttft_s for s in stats]) * 1000.0, tpot_ms_mean=_mean(tpots) * 1000.0,
        tau=tally.cycle_tokens / tally.cycles if tally.cycles else float("nan"),
        mean_verify_len=tally.verified_drafts / tally.cycles if tally.cycles else 0.0,
        draft_fraction=tally.drafted_cycles / tally.cycles if tally.cycles else 0.0,
        mean_budget=mean_budget, duration_s=duration, requests=len(stats), events=events, wall_s=wall_s,
        extra=_cache_view(tally))


def _cache_view(tally: Tally) -> dict:
    looked = tally.cache_hits + tally.cache_misses
    return {"cache_hits": tally.cache_hits, "cache_hit_rate": tally.cache_hits / looked} if looked else {}

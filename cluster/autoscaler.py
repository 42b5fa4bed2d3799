"""Replica counts of the two pools from the load board, each pool on its own signal.

Verifiers scale on saturation: the mean over replicas of max(KV in use / KV total, 1 if requests
queue for a slot). Drafters scale on queueing: drafts waiting per replica. A signal must stay past
its threshold for the pool's delay (up or down) before the count moves by one, within min..max,
and a pool changes at most once per cool-down, so one load spike does not flap the pool. Removal
itself (draining first) is the controller's job. No Ray, no Redis: loads come in as `EngineLoad`s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from cluster.settings import AutoscalerSettings, PoolSettings
from services.load_board import EngineLoad


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    pool: str  # verifier | drafter
    before: int
    after: int
    reason: str  # autoscaler: the signal and its value; manual: "dspark scale"
    at: float  # wall clock


@dataclass(slots=True)
class _Trend:
    above_since: float | None = None
    below_since: float | None = None
    last_change: float = float("-inf")


def pool_signal(pool: str, loads: list[EngineLoad]) -> float | None:
    """The pool's scaling signal from its replicas' board entries (None: no entry to judge by)."""
    if not loads:
        return None
    if pool == "verifier":
        per = [1.0 if x.queued else (x.kv_used / x.kv_total if x.kv_total else 0.0) for x in loads]
    else:
        per = [float(x.queued) for x in loads]
    return sum(per) / len(per)


class Autoscaler:
    def __init__(self, settings: AutoscalerSettings, bounds: dict[str, PoolSettings]):
        self.s, self.bounds = settings, bounds
        self._trends = {pool: _Trend() for pool in bounds}

    def thresholds(self, pool: str) -> tuple[float, float]:
        s = self.s
        return (s.verifier_low, s.verifier_high) if pool == "verifier" else (s.drafter_low, s.drafter_high)

    def decide(self, pool: str, replicas: int, signal: float | None, now: float | None = None) -> ScaleEvent | None:
        """The next count of `pool` (currently `replicas`) given its signal, or None to keep it."""
        now = time.monotonic() if now is None else now
        trend, bound = self._trends[pool], self.bounds[pool]
        low, high = self.thresholds(pool)
        if replicas < bound.min_replicas or replicas > bound.max_replicas:
            return self._change(pool, replicas, min(max(replicas, bound.min_replicas), bound.max_replicas),
                                f"outside [{bound.min_replicas}, {bound.max_replicas}]", now)
        if signal is None:
            trend.above_since = trend.below_since = None
            return None
        trend.above_since = (now if trend.above_since is None else trend.above_since) if signal > high else None
        trend.below_since = (now if trend.below_since is None else trend.below_since) if signal < low else None
        if now - trend.last_change < self.s.cooldown_s:
            return None
        if trend.above_since is not None and now - trend.above_since >= self.s.upscale_delay_s \
                and replicas < bound.max_replicas:
            return self._change(pool, replicas, replicas + 1, f"signal {signal:.2f} > {high}", now)
        if trend.below_since is not None and now - trend.below_since >= self.s.downscale_delay_s \
                and replicas > bound.min_replicas:
            return self._change(pool, replicas, replicas - 1, f"signal {signal:.2f} < {low}", now)
        return None

    def manual(self, pool: str) -> None:
        """A count set by hand starts the pool's cool-down, so the autoscaler does not undo it at once."""
        self._trends[pool] = _Trend(last_change=time.monotonic())

    def _change(self, pool: str, before: int, after: int, reason: str, now: float) -> ScaleEvent:
        self._trends[pool] = _Trend(last_change=now)
        return ScaleEvent(pool, before, after, reason, time.time())

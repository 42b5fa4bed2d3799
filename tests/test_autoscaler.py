"""The autoscaler's decisions (delays, cool-down, bounds, manual changes) and its pool signals, with time
driven through `now`."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.autoscaler import Autoscaler, ScaleEvent, pool_signal
from cluster.settings import AutoscalerSettings, PoolSettings
from services.load_board import EngineLoad

T0 = 1000.0  # a monotonic-like origin for `now`
S = AutoscalerSettings(enabled=True, verifier_high=0.8, verifier_low=0.3, drafter_high=2.0, drafter_low=0.5,
                       upscale_delay_s=10.0, downscale_delay_s=60.0, cooldown_s=30.0)


def scaler(settings_: AutoscalerSettings = S, vmin=1, vmax=4, dmin=1, dmax=3) -> Autoscaler:
    bounds = {"verifier": PoolSettings(replicas=vmin, min_replicas=vmin, max_replicas=vmax),
              "drafter": PoolSettings(replicas=dmin, min_replicas=dmin, max_replicas=dmax)}
    return Autoscaler(settings_, bounds)


def test_thresholds_per_pool():
    a = scaler()
    assert a.thresholds("verifier") == (0.3, 0.8) and a.thresholds("drafter") == (0.5, 2.0)


def test_no_upscale_before_the_delay_then_plus_one():
    a = scaler()
    for dt in (0.0, 3.0, 9.99):
        assert a.decide("verifier", 2, 0.95, now=T0 + dt) is None
    event = a.decide("verifier", 2, 0.95, now=T0 + 10.0)
    assert isinstance(event, ScaleEvent)
    assert (event.pool, event.before, event.after) == ("verifier", 2, 3)
    assert "0.95" in event.reason and "0.8" in event.reason
    assert abs(event.at - time.time()) < 5  # wall clock, for display


def test_signal_must_stay_above_for_the_whole_delay():
    a = scaler()
    assert a.decide("verifier", 1, 0.9, now=T0) is None
    assert a.decide("verifier", 1, 0.5, now=T0 + 5) is None  # dips between thresholds: trend restarts
    assert a.decide("verifier", 1, 0.9, now=T0 + 6) is None
    assert a.decide("verifier", 1, 0.9, now=T0 + 15) is None  # 9 s above since the dip
    assert a.decide("verifier", 1, 0.9, now=T0 + 16).after == 2
    # Exactly at the threshold is not above it.
    b = scaler()
    assert b.decide("verifier", 1, 0.8, now=T0) is None
    assert b.decide("verifier", 1, 0.8, now=T0 + 100) is None


def test_downscale_after_its_own_delay():
    a = scaler()
    assert a.decide("drafter", 3, 0.1, now=T0) is None
    assert a.decide("drafter", 3, 0.2, now=T0 + 30) is None
    assert a.decide("drafter", 3, 0.0, now=T0 + 59.9) is None
    event = a.decide("drafter", 3, 0.0, now=T0 + 60)
    assert (event.pool, event.before, event.after) == ("drafter", 3, 2) and "< 0.5" in event.reason
    # A signal between the thresholds never moves the pool.
    b = scaler()
    for t in range(0, 500, 10):
        assert b.decide("drafter", 2, 1.0, now=T0 + t) is None


def test_cooldown_blocks_a_second_change():
    a = scaler()
    a.decide("verifier", 1, 0.9, now=T0)
    assert a.decide("verifier", 1, 0.9, now=T0 + 10).after == 2
    # Still above: the trend holds for longer than the delay, but the cool-down (30 s) blocks.
    for dt in (11, 21, 25, 39.9):
        assert a.decide("verifier", 2, 0.9, now=T0 + dt) is None
    assert a.decide("verifier", 2, 0.9, now=T0 + 40).after == 3
    # Downscale waits for the cool-down too, even after a long low spell.
    assert a.decide("verifier", 3, 0.0, now=T0 + 41) is None
    assert a.decide("verifier", 3, 0.0, now=T0 + 69.9) is None
    assert a.decide("verifier", 3, 0.0, now=T0 + 101) is not None  # 60 s low since T0 + 41


def test_pools_scale_independently():
    a = scaler()
    a.decide("verifier", 1, 0.9, now=T0)
    a.decide("drafter", 1, 5.0, now=T0)
    assert a.decide("verifier", 1, 0.9, now=T0 + 10).after == 2
    assert a.decide("drafter", 1, 5.0, now=T0 + 10).after == 2  # the verifier's cool-down is not the drafter's


def test_never_beyond_max_or_below_min():
    a = scaler(vmin=1, vmax=2)
    a.decide("verifier", 2, 1.0, now=T0)
    for dt in range(0, 300, 5):
        assert a.decide("verifier", 2, 1.0, now=T0 + dt) is None
    b = scaler(vmin=2, vmax=4)
    for dt in range(0, 300, 5):
        assert b.decide("verifier", 2, 0.0, now=T0 + dt) is None


def test_counts_outside_the_bounds_are_corrected_at_once():
    a = scaler(vmin=2, vmax=3)
    event = a.decide("verifier", 0, None, now=T0)
    assert (event.before, event.after) == (0, 2) and "outside [2, 3]" in event.reason
    # ... even within a cool-down and whatever the signal.
    event = a.decide("verifier", 7, 0.0, now=T0 + 1)
    assert (event.before, event.after) == (7, 3)
    # A correction starts a cool-down of its own (here until T0 + 31).
    assert a.decide("verifier", 2, 0.9, now=T0 + 2) is None
    assert a.decide("verifier", 2, 0.9, now=T0 + 12) is None  # above for the upscale delay, cooling down
    assert a.decide("verifier", 2, 0.9, now=T0 + 30.9) is None
    assert a.decide("verifier", 2, 0.9, now=T0 + 31).after == 3


def test_none_signal_resets_the_trends():
    a = scaler()
    a.decide("verifier", 1, 0.9, now=T0)
    assert a.decide("verifier", 1, None, now=T0 + 5) is None  # board unavailable
    assert a.decide("verifier", 1, 0.9, now=T0 + 10) is None  # would have fired without the reset
    assert a.decide("verifier", 1, 0.9, now=T0 + 19) is None
    assert a.decide("verifier", 1, 0.9, now=T0 + 20).after == 2
    b = scaler()
    b.decide("drafter", 2, 0.0, now=T0)
    b.decide("drafter", 2, None, now=T0 + 59)
    assert b.decide("drafter", 2, 0.0, now=T0 + 60) is None
    assert b.decide("drafter", 2, 0.0, now=T0 + 120).after == 1


def test_manual_change_starts_a_cooldown():
    a = scaler()
    a.decide("verifier", 1, 0.9, now=time.monotonic())
    a.manual("verifier")
    now = time.monotonic()
    # Above the threshold well past the upscale delay, but the count set by hand holds for the cool-down.
    a.decide("verifier", 1, 0.9, now=now)
    assert a.decide("verifier", 1, 0.9, now=now + 29) is None
    assert a.decide("verifier", 1, 0.9, now=now + 31).after == 2
    # The other pool is not affected.
    a.decide("drafter", 1, 5.0, now=now)
    assert a.decide("drafter", 1, 5.0, now=now + 10).after == 2


def test_zero_delays_and_cooldown_move_at_once():
    a = scaler(AutoscalerSettings(upscale_delay_s=0, downscale_delay_s=0, cooldown_s=0))
    assert a.decide("verifier", 1, 0.99, now=T0).after == 2
    assert a.decide("verifier", 2, 0.99, now=T0).after == 3
    assert a.decide("verifier", 3, 0.0, now=T0 + 1).after == 2


def test_upscale_delay_counts_from_a_now_of_zero():
    """`now` is any clock the caller drives; 0.0 is a valid instant (a clock started at 0)."""
    a = scaler()
    assert a.decide("verifier", 1, 0.9, now=0.0) is None
    assert a.decide("verifier", 1, 0.9, now=5.0) is None
    event = a.decide("verifier", 1, 0.9, now=10.0)  # above since 0.0 for the full 10 s delay
    assert event is not None and event.after == 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 20.0), st.one_of(st.none(), st.floats(0.0, 3.0))), max_size=80),
       st.integers(0, 6))
def test_decisions_stay_within_bounds_and_respect_the_cooldown(steps, start):
    a = scaler(vmin=1, vmax=4)
    replicas, now, last_change = start, T0, None
    for dt, signal in steps:
        now += dt
        event = a.decide("verifier", replicas, signal, now=now)
        if event is None:
            continue
        assert event.before == replicas
        outside = not 1 <= replicas <= 4
        if outside:
            assert event.after == min(max(replicas, 1), 4)
        else:
            assert abs(event.after - replicas) == 1 and 1 <= event.after <= 4
            assert last_change is None or now - last_change >= S.cooldown_s
            assert signal is not None and (signal > S.verifier_high or signal < S.verifier_low)
            assert (event.after > replicas) == (signal > S.verifier_high)
        replicas, last_change = event.after, now


# ---- pool signals -----------------------------------------------------------------------------------
def vload(queued=0, kv_used=0, kv_total=100) -> EngineLoad:
    return EngineLoad("v", "verifier", queued=queued, kv_used=kv_used, kv_total=kv_total)


def test_verifier_signal_is_mean_saturation_with_queueing_as_full():
    assert pool_signal("verifier", [vload(kv_used=50)]) == pytest.approx(0.5)
    assert pool_signal("verifier", [vload(kv_used=20), vload(kv_used=60)]) == pytest.approx(0.4)
    assert pool_signal("verifier", [vload(queued=3, kv_used=10), vload(kv_used=0)]) == pytest.approx(0.5)
    assert pool_signal("verifier", [vload(queued=1, kv_used=0, kv_total=0)]) == 1.0
    assert pool_signal("verifier", [vload(kv_used=0, kv_total=0)]) == 0.0  # no KV reported yet
    assert pool_signal("verifier", []) is None


def test_drafter_signal_is_mean_queued_drafts():
    loads = [EngineLoad("d1", "drafter", queued=3, kv_used=99, kv_total=100), EngineLoad("d2", "drafter", queued=0),
             EngineLoad("d3", "drafter", queued=6)]
    assert pool_signal("drafter", loads) == pytest.approx(3.0)
    assert pool_signal("drafter", [EngineLoad("d", "drafter")]) == 0.0
    assert pool_signal("drafter", []) is None


def test_signal_drives_the_decision():
    a = scaler()
    busy = [vload(queued=2), vload(kv_used=90)]
    for t in (0, 10):
        event = a.decide("verifier", 2, pool_signal("verifier", busy), now=T0 + t)
    assert event is not None and event.after == 3
    assert a.decide("verifier", 3, pool_signal("verifier", []), now=T0 + 100) is None

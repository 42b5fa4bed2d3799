"""The load board against a real redis-server (a private one on a free loopback port) and in process."""

from __future__ import annotations

import time

import pytest

from services.load_board import EngineLoad, LocalBoard, RedisBoard
from tests.tiers import private_redis


@pytest.fixture
def redis_server():
    with private_redis() as server:
        yield server


def _load(engine: str, seq: int, **kw) -> EngineLoad:
    return EngineLoad(engine, "verifier", seq=seq, ts=time.time(), **kw)


@pytest.mark.parametrize("kind", ["local", "redis"])
def test_publish_read_and_ttl_expiry(kind, request):
    board = LocalBoard() if kind == "local" else RedisBoard(request.getfixturevalue("redis_server").url)
    assert board.publish(_load("v0", 1, running=3, kv_used=50, kv_total=100), ttl_s=0.3)
    assert board.publish(_load("v1", 7), ttl_s=5)
    assert board.publish_profile("v0", [(1, 20.0), (8, 21.5)])
    loads = board.read("verifier")
    assert [(x.engine_id, x.seq, x.running) for x in loads] == [("v0", 1, 3), ("v1", 7, 0)]
    assert loads[0].saturation(stale_after_s=1.0) == 0.5
    assert board.profile("v0") == [(1, 20.0), (8, 21.5)] and board.read("drafter") == []
    time.sleep(0.4)
    assert [x.engine_id for x in board.read("verifier")] == ["v1"]  # v0's key expired


def test_stale_entries_count_as_saturated():
    old = EngineLoad("v0", "verifier", kv_used=0, kv_total=100, ts=time.time() - 5)
    assert old.saturation(stale_after_s=0.2) == 1.0


def test_redis_outage_degrades_to_unavailable_then_recovers(redis_server):
    board = RedisBoard(redis_server.url, timeout_s=0.05, cooldown_s=0.2)
    assert board.publish(_load("v0", 1), ttl_s=10) and len(board.read("verifier")) == 1
    redis_server.stop()
    t0 = time.monotonic()
    results = [board.read("verifier") for _ in range(50)]  # a burst of reads while Redis is down
    assert all(r is None for r in results) and not board.publish(_load("v0", 2), ttl_s=10)
    assert time.monotonic() - t0 < 1.0 and board.failures <= 3  # the breaker keeps Redis off the hot path
    redis_server.start()
    time.sleep(0.25)  # past the cool-down
    assert board.publish(_load("v0", 3), ttl_s=10)
    assert [x.seq for x in board.read("verifier")] == [3]


def test_tier_processes_publish_their_load(redis_server):
    from cluster.launcher import start_tiers, stop_tiers
    from tests.tiers import drafter_settings, verifier_settings

    tiers = start_tiers([("verifier", verifier_settings(redis_url=redis_server.url)),
                         ("drafter", drafter_settings(drafters=["dspark-target-mtp"], redis_url=redis_server.url))])
    board = RedisBoard(redis_server.url)
    try:
        seen = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(seen) < 3:
            loads = (board.read("verifier") or []) + (board.read("drafter") or [])
            if len(loads) == 2:
                seen.append({x.role: x for x in loads})
            time.sleep(0.15)
    finally:
        stop_tiers(tiers)
    assert len(seen) == 3
    verifier = seen[-1]["verifier"]
    assert verifier.engine_id == tiers[0].address and verifier.kv_total == 8 * 512 and verifier.running == 0
    assert seen[-1]["verifier"].seq > seen[0]["verifier"].seq and seen[-1]["drafter"].engine_id == tiers[1].address
    assert verifier.saturation(stale_after_s=1.0, now=verifier.ts) == 0.0  # fresh and idle


def test_dspark_top_shows_the_board(redis_server, capsys, monkeypatch):
    from cli.main import main

    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal, so rich does not elide the columns
    board = RedisBoard(redis_server.url)
    board.publish(EngineLoad("10.0.0.5:50051", "verifier", running=2, kv_used=10, kv_total=40, seq=4,
                             ts=time.time()), ttl_s=10)
    board.publish(EngineLoad("10.0.0.6:50052", "drafter", queued=1, seq=9, ts=time.time() - 60), ttl_s=10)
    assert main(["top", "--redis-url", redis_server.url, "--once"]) == 0
    out = capsys.readouterr().out
    assert "10.0.0.5:50051" in out and "10/40" in out and "0.25" in out  # fresh: KV saturation
    assert "10.0.0.6:50052" in out and "1.00" in out  # stale: counted as saturated


def test_board_view_freshness_follows_seq_on_the_readers_clock():
    from router.scheduling.board_view import BoardView

    view = BoardView(LocalBoard(), stale_after_s=0.5)
    assert view.view("v0", own_requests=2).fallback  # nothing read yet
    view.update([EngineLoad("v0", "verifier", running=6, batch_tokens=30, seq=1, ts=0.0)], now=10.0)
    v = view.view("v0", own_requests=2, now=10.1)
    # Four requests of other routers, each carrying (30 − 6) / 6 = 4 tokens beyond its anchor.
    assert (v.fallback, v.other_requests, v.other_tokens) == (False, 4, 16)
    view.update([EngineLoad("v0", "verifier", running=6, seq=1, ts=0.0)], now=10.4)  # seq did not move
    assert view.view("v0", 2, now=10.6).fallback  # stale: 0.6 s since seq last moved
    view.update([EngineLoad("v0", "verifier", running=1, seq=2, ts=0.0)], now=10.7)
    assert view.view("v0", 2, now=10.8) == type(v)(0, 0, fallback=False)  # fresh again; fewer than ours
    view.update(None, now=10.9)  # the board stopped answering
    assert view.view("v0", 2, now=10.9).fallback and not view.available

"""The load board against a real redis-server (a private one on a free loopback port) and in process."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest

from services.load_board import EngineLoad, LocalBoard, RedisBoard


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self):
        self.port = _free_port()
        self.process = None

    def start(self) -> None:
        self.process = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                         "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


@pytest.fixture
def redis_server():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make test installs it)")
    server = RedisServer()
    server.start()
    yield server
    server.stop()


def _load(engine: str, seq: int, **kw) -> EngineLoad:
    return EngineLoad(engine, "verifier", seq=seq, ts=time.time(), **kw)


@pytest.mark.parametrize("kind", ["local", "redis"])
def test_publish_read_and_ttl_expiry(kind, request):
    board = LocalBoard() if kind == "local" else RedisBoard(
        f"redis://127.0.0.1:{request.getfixturevalue('redis_server').port}/0")
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
    board = RedisBoard(f"redis://127.0.0.1:{redis_server.port}/0", timeout_s=0.05, cooldown_s=0.2)
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

"""The user-space network path (benchmarks/net_proxy.py) that stands in for netem here: it delays each direction
by its one-way latency, turns loss into late data (a retransmission), keeps bytes and order intact, and carries a
gRPC stream between a router and a tier."""

from __future__ import annotations

import socket
import socketserver
import threading
import time

import pytest

from benchmarks.net_proxy import NetProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self):
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def echo():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _round_trip(address: str, payload: bytes) -> tuple[bytes, float]:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        started = time.monotonic()
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            got += s.recv(65536)
        return got, time.monotonic() - started


def test_each_direction_waits_its_one_way_latency(echo):
    proxy = NetProxy(echo, one_way_s=0.05)
    try:
        got, seconds = _round_trip(proxy.address, b"ping")
        assert got == b"ping" and seconds >= 0.1  # 50 ms there, 50 ms back: never sooner
        proxy.set_path(one_way_s=0.0)
        assert _round_trip(proxy.address, b"pong")[0] == b"pong"
    finally:
        proxy.close()


def test_loss_is_late_data_never_missing_or_reordered(echo):
    proxy = NetProxy(echo, loss=0.5, rto_s=0.02, seed=1)
    try:
        payload = bytes(range(256)) * 64
        for _ in range(20):
            got, _ = _round_trip(proxy.address, payload)
            assert got == payload
        assert proxy.stats.lost > 0 and proxy.stats.chunks > proxy.stats.lost
    finally:
        proxy.close()


def test_a_bad_path_is_refused():
    with pytest.raises(ValueError, match="loss"):
        NetProxy("127.0.0.1:1", loss=1.0)

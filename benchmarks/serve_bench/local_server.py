"""A `dspark serve` of its own for a benchmark run, on a free loopback port."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


@contextlib.contextmanager
def serve_locally(config: Path | None, log: Path, model: str | None = None):
    """`dspark serve` on a free loopback port for the run → its base URL; stopped (SIGTERM) afterwards.
    `model` (a shipped name or a directory) overrides the config's target for every role."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "cli.main", "serve", "--port", str(port)]
    if config is not None:
        cmd += ["--config", str(config)]
    if model is not None:
        cmd += ["--model", model]
    with log.open("w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not _healthy(base):
            if server.poll() is not None:
                raise RuntimeError(f"dspark serve exited with {server.returncode}; see {log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"dspark serve did not become healthy in 300 s; see {log}")
            time.sleep(0.5)
        yield base
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False

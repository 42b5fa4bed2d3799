"""Start tier processes on this host and learn their addresses (`dspark serve`, tests, benchmarks).

Each tier runs as `python -m verifier_worker|drafter_worker --config FILE --address-file FILE` (its own
composition root, no router or CLI imported); the child writes its
bound address (port 0 becomes a free port) once its gRPC server is serving, and the launcher waits
for that file, so nothing races for ports.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel


@dataclass
class TierProcess:
    role: str
    process: subprocess.Popen
    address: str

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (graceful shutdown), then SIGKILL if it lingers."""
        self.terminate()
        self.wait(timeout_s)

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float = 10.0) -> None:
        """Until it exits; SIGKILL after `timeout_s`."""
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def stop_tiers(tiers: list[TierProcess], timeout_s: float = 10.0) -> None:
    """Stop every tier at once: SIGTERM to all, then wait for each (an interpreter with torch loaded takes
    about half a second to exit here; one after the other, a pair took twice that)."""
    for tier in tiers:
        tier.terminate()
    for tier in tiers:
        tier.wait(timeout_s)


def _die_with_parent() -> list[str]:
    """A command prefix under which the child gets SIGTERM when its launcher dies, however it dies.

    util-linux `setpriv --pdeathsig` sets PR_SET_PDEATHSIG in the child before exec. A Python
    `preexec_fn` would do the same, but running Python in a child forked from a process with gRPC
    threads can crash or deadlock it; without setpriv the owner's own stop() is the only cleanup.
    """
    return ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []


def start_tier(role: str, settings: BaseModel, timeout_s: float = 120.0, env: dict | None = None) -> TierProcess:
    """Spawn `dspark ROLE` with these settings and wait until it serves."""
    return start_tiers([(role, settings)], timeout_s, env)[0]


_MODULE = {"verifier": ("verifier_worker",), "drafter": ("drafter_worker",), "router": ("cli.main", "router")}


def start_tiers(roles: list[tuple[str, BaseModel]], timeout_s: float = 120.0,
                env: dict | None = None) -> list[TierProcess]:
    """Spawn every role at once (they load their models in parallel), then wait until each serves."""
    pending = []
    for role, settings in roles:
        workdir = Path(tempfile.mkdtemp(prefix=f"dspark-{role}-"))
        config, address_file = workdir / "config.yaml", workdir / "address"
        config.write_text(yaml.safe_dump(settings.model_dump(mode="json")))
        cmd = [sys.executable, "-m", *_MODULE[role], "--config", str(config), "--address-file", str(address_file)]
        process = subprocess.Popen([*_die_with_parent(), *cmd], env={**os.environ, **(env or {})},
                                   cwd=Path(__file__).resolve().parents[1])
        pending.append((role, process, address_file))
    deadline = time.monotonic() + timeout_s
    started = []
    try:
        for role, process, address_file in pending:
            while not address_file.is_file() or not address_file.read_text():
                if process.poll() is not None:
                    raise RuntimeError(f"{role} exited with {process.returncode} before serving")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{role} did not start within {timeout_s} s")
                time.sleep(0.1)
            started.append(TierProcess(role, process, address_file.read_text()))
    except BaseException:
        for _, process, _ in pending:
            process.kill()
        raise
    return started


class RedisProcess:
    """A private redis-server on a free loopback port, no persistence (the embedded load board, tests).
    `config`: a redis.conf to start from (e.g. infra/redis/redis.conf with its ACL user); the port, the
    loopback bind and no persistence still win over it."""

    def __init__(self, port: int = 0, config: Path | None = None):
        if port == 0:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        self.port, self.config, self.process = port, config, None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisProcess:
        config = [str(self.config)] if self.config is not None else []
        self.process = subprocess.Popen([*_die_with_parent(), "redis-server", *config, "--port", str(self.port),
                                         "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                                        stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        self.process.kill()
        raise TimeoutError(f"redis-server did not start (exit status {self.process.wait()})")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)

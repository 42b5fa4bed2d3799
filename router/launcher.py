"""Start tier processes on this host and learn their addresses (`dspark serve`, tests, benchmarks).

Each role runs as `python -m router.cli ROLE --config FILE --address-file FILE`; the child writes its
bound address (port 0 becomes a free port) once its gRPC server is serving, and the launcher waits
for that file, so nothing races for ports.
"""

from __future__ import annotations

import os
import signal
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
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def start_tier(role: str, settings: BaseModel, timeout_s: float = 120.0, env: dict | None = None) -> TierProcess:
    """Spawn `dspark ROLE` with these settings and wait until it serves."""
    workdir = Path(tempfile.mkdtemp(prefix=f"dspark-{role}-"))
    config, address_file = workdir / "config.yaml", workdir / "address"
    config.write_text(yaml.safe_dump(settings.model_dump(mode="json")))
    cmd = [sys.executable, "-m", "router.cli", role, "--config", str(config), "--address-file", str(address_file)]
    process = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, cwd=Path(__file__).resolve().parents[1])
    deadline = time.monotonic() + timeout_s
    while not address_file.is_file() or not address_file.read_text():
        if process.poll() is not None:
            raise RuntimeError(f"{role} exited with {process.returncode} before serving")
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError(f"{role} did not start within {timeout_s} s")
        time.sleep(0.1)
    return TierProcess(role, process, address_file.read_text())

"""Hosts for tests: network namespaces on one bridge, each with its own address, as separate machines would be.

`Hosts(["a", "b", "c"])` makes, as root, a Linux bridge and per host a namespace joined to it by a veth pair, with
addresses 10.213.N.11, .12, … (N from this process's id, so parallel runs do not meet) and the bridge at .1 —
which is how the test process itself, in the root namespace, reaches the hosts. `run` starts a process inside a
host (its own Ray temp dir under the host's scratch directory); `partition` / `heal` take a host's link down and
up; `kill` ends every process in a host at once (a host dying); leaving the context removes everything, whatever
happened. Names carry the creating pid, so `sweep()` removes what a killed run left behind (at the next start).
Only addresses of hosts made here are ever used; nothing outside the machine is touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

PREFIX = "dsp"  # every namespace, bridge and veth made here starts with it, then the creator's pid


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> bool:
    """Root with `ip netns` and bridges (the CI machine is such a machine)."""
    return os.geteuid() == 0 and shutil.which("ip") is not None


def sweep() -> None:
    """Remove namespaces, bridges and veths that a run which no longer exists left behind."""
    names = _ip("netns", "list", check=False).stdout.split()
    links = re.findall(r"^\d+: ([^:@]+)", _ip("-o", "link", "show", check=False).stdout, flags=re.M)
    for name in names + links:
        match = re.match(rf"^{PREFIX}(\d+)", name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            if name in names:
                _kill_all(name)
                _ip("netns", "delete", name, check=False)
            else:
                _ip("link", "delete", name, check=False)


def _kill_all(ns: str) -> set[int]:
    pids = {int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


class Hosts:
    def __init__(self, names: list[str]):
        pid = os.getpid()
        self.tag = f"{PREFIX}{pid}"
        self.subnet = f"10.213.{pid % 250}"
        self.bridge = f"{self.tag}br"[:15]
        self.gateway = f"{self.subnet}.1"
        self.names = list(names)
        self.address = {n: f"{self.subnet}.{11 + i}" for i, n in enumerate(names)}
        self.ns = {n: f"{self.tag}-{n}" for n in names}
        self._veth = {n: f"{self.tag}v{i}"[:15] for i, n in enumerate(names)}
        self.scratch = Path(tempfile.mkdtemp(prefix=f"{self.tag}-", dir="/tmp"))
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Hosts:
        sweep()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for name in self.names:
                ns, veth, peer = self.ns[name], self._veth[name], f"{self._veth[name]}p"[:15]
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
                _ip("link", "set", peer, "netns", ns)
                self.exec(name, ["ip", "link", "set", "lo", "up"])
                self.exec(name, ["ip", "addr", "add", f"{self.address[name]}/24", "dev", peer])
                self.exec(name, ["ip", "link", "set", peer, "up"])
                self.exec(name, ["ip", "route", "add", "default", "via", self.gateway])
                (self.scratch / name).mkdir()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def exec(self, host: str, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        """Run `cmd` inside `host` to completion."""
        return subprocess.run(["ip", "netns", "exec", self.ns[host], *cmd], capture_output=True, text=True,
                              check=kw.pop("check", True), **kw)

    def run(self, host: str, cmd: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start `cmd` inside `host`, with its own temp and Ray directories; ended when the hosts are removed."""
        home = self.scratch / host
        env = {**os.environ, "TMPDIR": str(home), "RAY_TMPDIR": str(home), **(env or {})}
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns[host], *cmd], env=env, **kw)
        self.procs.append(proc)
        return proc

    def partition(self, host: str) -> None:
        """Cut `host` off the network (its processes live on)."""
        _ip("link", "set", self._veth[host], "down")

    def heal(self, host: str) -> None:
        _ip("link", "set", self._veth[host], "up")

    def kill(self, host: str) -> None:
        """The host dies: every process in it, at once (those started here are reaped)."""
        pids = _kill_all(self.ns[host])
        for proc in self.procs:
            if proc.pid in pids:
                proc.wait(timeout=10)

    def close(self) -> None:
        for name in self.names:
            _kill_all(self.ns[name])
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for name in self.names:
            _ip("netns", "delete", self.ns[name], check=False)
            _ip("link", "delete", self._veth[name], check=False)
        _ip("link", "delete", self.bridge, check=False)
        shutil.rmtree(self.scratch, ignore_errors=True)

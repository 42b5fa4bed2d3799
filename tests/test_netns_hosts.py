"""The hosts harness (tests/netns_hosts.py): hosts reach each other by their own addresses, a partition cuts a host
off and healing brings it back, a killed host loses every process, nothing is left after the run or after a run that
was killed."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import pytest

from tests.netns_hosts import PREFIX, Hosts, _ip, available, sweep

pytestmark = pytest.mark.skipif(not available(), reason="needs root and iproute2 (the CI machine has both)")
PORT = 18080


def _fetch(hosts: Hosts, src: str, dst: str, timeout: float = 2.0) -> bool:
    code = (f"import urllib.request,sys; urllib.request.urlopen('http://{hosts.address[dst]}:{PORT}/', "
            f"timeout={timeout}); sys.exit(0)")
    return hosts.exec(src, [sys.executable, "-c", code], check=False, timeout=timeout + 10).returncode == 0


def _serve(hosts: Hosts, host: str) -> subprocess.Popen:
    proc = hosts.run(host, [sys.executable, "-m", "http.server", str(PORT), "--bind", hosts.address[host]],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(50):
        if _fetch(hosts, "a", host, timeout=0.5):
            return proc
        time.sleep(0.2)
    raise AssertionError(f"no server on {host}")


def test_hosts_reach_each_other_partition_heal_and_die():
    with Hosts(["a", "b", "c"]) as hosts:
        assert len(set(hosts.address.values())) == 3
        _serve(hosts, "b")
        assert _fetch(hosts, "a", "b") and _fetch(hosts, "c", "b")
        with urllib.request.urlopen(f"http://{hosts.address['b']}:{PORT}/", timeout=2) as r:  # from the test, too
            assert r.status == 200
        own = hosts.exec("a", ["ip", "-4", "-o", "addr", "show"]).stdout
        assert hosts.address["a"] in own and hosts.address["b"] not in own  # a host has its own address only
        hosts.partition("b")
        assert not _fetch(hosts, "a", "b", timeout=1.0)
        hosts.heal("b")
        for _ in range(20):
            if _fetch(hosts, "a", "b"):
                break
            time.sleep(0.3)
        else:
            raise AssertionError("b did not come back")
        hosts.kill("b")
        assert _ip("netns", "pids", hosts.ns["b"]).stdout.split() == []
        assert not _fetch(hosts, "a", "b", timeout=1.0)
        tag = hosts.tag
    assert tag not in _ip("netns", "list").stdout and tag not in _ip("-o", "link", "show").stdout


def test_what_a_killed_run_left_is_swept():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    ns, bridge = f"{PREFIX}{dead.pid}-x", f"{PREFIX}{dead.pid}br"[:15]
    _ip("netns", "add", ns)
    _ip("link", "add", bridge, "type", "bridge")
    sweep()
    assert ns not in _ip("netns", "list").stdout and bridge not in _ip("-o", "link", "show").stdout

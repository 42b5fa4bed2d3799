"""A half-minute soak of `dspark serve` (benchmarks/soak.py starts its own; `make soak` runs ten minutes): no
request goes wrong, nothing leaks.

Timing and memory figures are printed, not asserted (the CI machine is shared and small), except one sanity
bound: no process of the deployment grows by more than 500 MB in the half minute. The replicas hold about 0.7 GB
each (target or drafters, torch, Ray's worker runtime) and allocator noise moves them by well under 100 MB
either way, so 500 MB in half a minute can only be a leak of more than a replica's size a minute, never noise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
CORE = {"dspark serve", "gcs_server", "raylet", "ray::Controller", "ray::VerifierReplica", "ray::DrafterReplica"}
MAX_GROWTH_MB = 500.0


@pytest.fixture(scope="module")
def soak(tmp_path_factory, pytestconfig) -> dict:
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    cmd = [sys.executable, "benchmarks/soak.py", "--duration", "30", "--sample-every", "2", "--long-tokens", "48",
           "--drain-s", "20", "--out", str(out), "--server-log", str(out.with_name("server.log"))]
    with pytestconfig.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        subprocess.run(cmd, cwd=ROOT, timeout=300, check=False)  # its report shows in the test's output
    assert out.is_file(), f"the soak wrote no results; see {out.with_name('server.log')}"
    return json.loads(out.read_text())


def test_no_request_goes_wrong(soak):
    errors = soak["errors"]
    assert errors["total"] == 0, errors["examples"]
    requests = soak["requests"]
    assert requests["completed"] > 0 and requests["completion"] and requests["chat"] and requests["streamed"]


def test_nothing_is_left_in_flight_after_the_load(soak):
    assert soak["leaks"] == {}
    last = soak["samples"][-1]
    assert not any(last["router"].values()) and not any(last["tiers"].values()), last


def test_every_process_was_sampled_throughout(soak):
    processes = soak["processes"]
    assert {p["label"] for p in processes} >= CORE
    assert soak["exited"] == []
    for p in processes:
        assert p["samples"] == p["expected_samples"] > 0, p["label"]
        assert p["growth_mb"] < MAX_GROWTH_MB, f"{p['label']} grew by {p['growth_mb']:.0f} MB in half a minute"

"""A verifier's SPS(B) table (verifier_worker/profile.py: `host_sps`): measured once per host and setup, reused
by the next start of the same setup, measured anew when anything the speed depends on differs."""

from __future__ import annotations

import json

import pytest

from verifier_worker import main, profile
from verifier_worker.main import start_profile, verifier_service
from verifier_worker.settings import VerifierSettings


@pytest.fixture()
def counted(monkeypatch, tmp_path):
    """The profiler, counted, over a cache of this test's own."""
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    calls = []
    measure = profile.profile_sps

    def counting(forward, **kw):
        calls.append(kw)
        return measure(forward, **{**kw, "batch_tokens": (1, 4), "context": 16, "repeats": 1})

    monkeypatch.setattr(profile, "profile_sps", counting)
    monkeypatch.setattr(main, "profile_sps", counting)
    return calls, tmp_path / "sps"


def test_a_second_start_reuses_the_table_this_host_measured(counted):
    calls, cache = counted
    s = VerifierSettings(dtype="float32", threads=1)
    forward = verifier_service(s).engine.forward
    first = start_profile(s, forward)
    again = start_profile(s, verifier_service(s).engine.forward)  # a restarted replica: a new engine, same setup
    assert len(calls) == 1 and again == first and len(first) == 2
    (entry,) = cache.iterdir()
    kept = json.loads(entry.read_text())
    assert kept["key"]["dtype"] == "torch.float32" and kept["key"]["threads"] == profile.torch.get_num_threads()
    assert [p["batch_tokens"] for p in kept["points"]] == [1, 4]


def test_another_setup_or_profile_cache_off_measures_anew(counted, monkeypatch):
    calls, cache = counted
    s = VerifierSettings(dtype="float32", threads=1)
    forward = verifier_service(s).engine.forward
    start_profile(s, forward)
    monkeypatch.setattr(profile.torch, "get_num_threads", lambda: 7)  # other threads: another speed
    start_profile(s, forward)
    start_profile(s.model_copy(update={"profile_cache": False}), forward)  # measured, nothing read or written
    assert len(calls) == 3 and len(list(cache.iterdir())) == 2


def test_an_unreadable_table_is_measured_again(counted):
    calls, cache = counted
    s = VerifierSettings(dtype="float32", threads=1)
    forward = verifier_service(s).engine.forward
    start_profile(s, forward)
    (entry,) = cache.iterdir()
    entry.write_text('{"points": [')  # a torn write of another tool, a full disk
    assert len(start_profile(s, forward)) == 2 and len(calls) == 2
    assert json.loads(entry.read_text())["points"]  # rewritten whole

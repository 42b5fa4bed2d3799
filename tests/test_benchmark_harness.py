"""The engine-speed harness the experiments share (benchmarks/harness.py): rounds alternate between arms after
warm-up, and an experiment built on it (`benchmarks/engine.py`, on a small random model) runs end to end with its
speculative greedy equal to plain greedy. (`benchmarks/gpu_check.py`, the other user run here, has its own test.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.harness import alternate, forward_ms, medians
from training.tiny_model import random_model, tiny_config

ROOT = Path(__file__).resolve().parents[1]


def test_rounds_alternate_between_arms_after_uncounted_warm_up():
    calls: list[str] = []

    def arm(name: str, value: float):
        return lambda: calls.append(name) or value

    samples = alternate({"a": arm("a", 1.0), "b": arm("b", 2.0)}, rounds=3, warm_up=1)
    assert calls == ["a", "b"] * 4  # one warm-up round, then three, the arms taking turns
    assert samples == {"a": [1.0] * 3, "b": [2.0] * 3} and medians(samples) == {"a": 1.0, "b": 2.0}


def test_forward_timings_cover_every_size():
    model = random_model(tiny_config(256, eos_id=0, layers=1, hidden=64), seed=0, std=0.05).eval()
    ms = forward_ms(model, [1, 8], context=16, rounds=2, batch=2)
    assert set(ms) == {1, 8} and all(t > 0 for t in ms.values())


def test_the_engine_experiment_runs_and_its_speculative_greedy_is_plain_greedy(tmp_path):
    out = tmp_path / "engine.json"
    subprocess.run([sys.executable, "benchmarks/engine.py", "--hidden", "64", "--layers", "1", "--vocab", "512",
                    "--batches", "1,2", "--gammas", "1,3", "--rounds", "2", "--decode-tokens", "8", "--json",
                    str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    record = json.loads(out.read_text())
    (identity,) = record["greedy_identity"]
    assert identity["identical_outputs"] == identity["outputs"] == 8
    assert identity["tau"] > 1.5  # the oracle's drafts were used, one in four wrong
    assert [r["batch"] for r in record["plain_decode"]] == [1, 2]
    assert record["meta"]["cpu"] and "native_bf16" in record["meta"]

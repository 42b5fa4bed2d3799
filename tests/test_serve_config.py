"""Role settings: file and flags merge (flag > file > default), unknown keys are errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from cli.main import build_parser
from cli.serve import serve_settings
from cluster.settings import ServeSettings
from services.errors import InvalidRequestError
from services.settings import load
from verifier_worker.settings import VerifierSettings

EXAMPLE = Path(__file__).resolve().parents[1] / "infra" / "serve.example.yaml"


def test_the_shipped_example_parses():
    settings = load(ServeSettings, EXAMPLE, {})
    assert settings.router.policy == "dspark" and len(settings.drafter.drafters) == 4


def test_the_benchmark_configs_parse_and_pin_the_tiers_apart():
    pinned = load(ServeSettings, EXAMPLE.parents[1] / "benchmarks" / "configs" / "serving-pinned.yaml", {})
    assert pinned.verifier.cpus == [0] and pinned.drafter.cpus == [1]
    both = load(ServeSettings, EXAMPLE.parents[1] / "benchmarks" / "configs" / "plain-two-cores.yaml", {})
    assert both.verifier.cpus == [0, 1] and both.verifier.threads == 2


def test_flags_beat_the_file_and_the_file_beats_defaults(tmp_path):
    path = tmp_path / "v.yaml"
    path.write_text("num_slots: 3\nmax_len: 300\n")
    args = build_parser().parse_args(["verifier", "--config", str(path), "--max-len", "400"])
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config", "address_file")}
    settings = load(VerifierSettings, path, flags)
    assert (settings.num_slots, settings.max_len, settings.max_batch_tokens) == (3, 400, 256)


def test_unknown_keys_and_bad_values_are_rejected(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("router: {port: 8000, colour: blue}\n")
    with pytest.raises(InvalidRequestError, match="colour"):
        load(ServeSettings, path, {})
    with pytest.raises(InvalidRequestError):
        load(VerifierSettings, None, {"num_slots": 0})


def test_serve_keeps_tiers_private_and_passes_model_and_tracing_to_every_role(monkeypatch):
    monkeypatch.setenv("DSPARK_API_KEY", "from-env")
    args = build_parser().parse_args(["serve", "--config", str(EXAMPLE), "--port", "9000", "--traces", "console"])
    settings = serve_settings(args)
    assert settings.router.port == 9000 and settings.router.api_key == ["from-env"]
    for role in (settings.verifier, settings.drafter):
        assert role.host == "127.0.0.1" and role.port == 0 and role.traces == "console"
    explicit = serve_settings(argparse.Namespace(**{**vars(args), "api_key": "flag-key"}))
    assert explicit.router.api_key == ["flag-key"]  # the flag beats DSPARK_API_KEY


def test_serve_flags_set_the_ray_address_and_the_pools(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("pools:\n  verifier: {max_replicas: 8, resources: {verifier_node: 1}}\n")
    args = build_parser().parse_args(["serve", "--config", str(path), "--address", "auto", "--verifier-replicas", "3",
                                      "--drafter-replicas", "2", "--tensor-parallel", "2"])
    s = serve_settings(args)
    assert s.ray.address == "auto"
    assert (s.pools.verifier.replicas, s.pools.verifier.tensor_parallel, s.pools.drafter.replicas) == (3, 2, 2)
    assert s.pools.verifier.resources == {"verifier_node": 1} and s.pools.verifier.max_replicas == 8  # file kept
    assert serve_settings(build_parser().parse_args(["serve"])).ray.address is None  # default: local instance


def test_pool_bounds_and_unsharded_drafters_are_enforced():
    with pytest.raises(InvalidRequestError, match="outside"):
        load(ServeSettings, None, {"pools": {"verifier": {"replicas": 5, "max_replicas": 4}}})
    with pytest.raises(InvalidRequestError, match="tensor_parallel"):
        load(ServeSettings, None, {"pools": {"drafter": {"tensor_parallel": 2}}})
    with pytest.raises(InvalidRequestError, match="Extra inputs"):
        load(ServeSettings, None, {"autoscaler": {"enable": True}})


def test_a_tier_pinned_to_cpus_takes_those_and_one_thread_each():
    """`cpus` pins the process (as taskset would) and sets one torch thread per pinned CPU; a CPU this process
    cannot have is refused by id. Run in a child process so the test process keeps its cores."""
    import os
    import subprocess
    import sys

    first = min(os.sched_getaffinity(0))
    code = (f"import os, torch; from protos.tier import set_threads; set_threads(0, [{first}]); "
            "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [f"[{first}]", "1"]
    from protos.tier import set_threads
    from services.errors import DsparkError

    with pytest.raises(DsparkError, match="cpus \\[100000\\] are not available"):
        set_threads(0, [100000])
    assert VerifierSettings(cpus=[first]).cpus == [first]

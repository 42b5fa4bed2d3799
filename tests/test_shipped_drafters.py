"""The shipped drafters: listed, loadable, lossless on the shipped target, and evaluated by `dspark eval`."""

from __future__ import annotations

import json

import pytest

from cli.main import main
from services.registry import MODELS_DIR, drafters_of, list_models
from tests.test_shipped_model import TARGET, _first_prompts

METHODS = ("mtp", "eagle3", "dflash", "dspark")
TARGETS = (TARGET, "dspark-target-v2")  # every shipped target ships all four methods
DRAFTERS = {method: f"{TARGET}-{method}" for method in METHODS}


def test_drafters_are_listed_with_their_target_and_calibration():
    entries = {e.name: e for e in list_models()}
    for target in TARGETS:
        for method in METHODS:
            assert entries[f"{target}-{method}"].kind == "drafter" and entries[f"{target}-{method}"].target == target
        assert (MODELS_DIR / f"{target}-dspark" / "calibration.json").is_file()


def test_the_drafters_of_a_target_are_the_ones_shipped_for_it():
    """What a drafter replica with no drafters named loads, and `dspark eval --drafter all` evaluates: a name,
    a GGUF file or a directory name the target by `model_name`; a drafter or unknown model has none."""
    for target in (*TARGETS, "gemma-3-270m"):
        assert sorted(drafters_of(target)) == sorted(f"{target}-{m}" for m in METHODS)
    assert sorted(drafters_of("/somewhere/gemma-3-270m.gguf")) == sorted(drafters_of("gemma-3-270m"))
    assert drafters_of(f"{TARGET}-dspark") == [] and drafters_of("no-such-model") == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: the AVX512 or AMX kernels where the CPU has them
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("method", METHODS)
def test_greedy_with_each_shipped_drafter_equals_plain(tmp_path, capsys, method, target, dtype):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in _first_prompts(1)))
    base = ["generate", "--model", target, "--prompts", str(prompts), "--max-tokens", "24", "--dtype", dtype,
            "--json", "--max-batch", "3"]
    assert main([*base, "--method", "none"]) == 0
    plain = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    gamma = "1" if method == "mtp" else "7"
    assert main([*base, "--method", method, "--drafter", f"{target}-{method}", "--gamma", gamma]) == 0
    spec = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert sum(r["num_accepted_tokens"] for r in spec) > 0  # the trained drafter really gets drafts accepted


def test_generate_refuses_a_drafter_of_another_method(capsys):
    assert main(["generate", "--model", TARGET, "--prompt", "x", "--method", "dflash",
                 "--drafter", DRAFTERS["dspark"]]) == 2
    assert "is a dspark drafter" in capsys.readouterr().err


def test_eval_reports_tau_acceptance_and_calibration(tmp_path, capsys):
    args = ["eval", "--drafter", DRAFTERS["dspark"], "--datasets", "math", "--prompts", "2", "--batch", "2",
            "--max-tokens", "16", "--gamma", "4", "--out-dir", str(tmp_path), "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    run = report["drafters"][DRAFTERS["dspark"]][0]
    math_run = run["datasets"]["math"]["batch2"]
    assert math_run["tau"] > 1.0 and len(math_run["accept_rate_at_k"]) == 4
    assert {"raw", "calibrated"} <= set(run["confidence"])
    assert "| drafter | γ | T | batch |" in (tmp_path / "eval.md").read_text()
    assert (tmp_path / "reliability-dspark-target-dspark-g4-t1.png").stat().st_size > 0


def test_eval_raw_confidences_do_not_depend_on_the_calibration_file(tmp_path, capsys):
    """`raw` is the confidence head's own σ(z); the calibration is applied once, in the report only."""
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(MODELS_DIR / DRAFTERS["dspark"], bare)
    (bare / "calibration.json").unlink()
    raw = {}
    for name, drafter in (("shipped", DRAFTERS["dspark"]), ("bare", str(bare))):
        args = ["eval", "--drafter", drafter, "--datasets", "code", "--prompts", "2", "--batch", "1",
                "--max-tokens", "12", "--gamma", "4", "--out-dir", str(tmp_path / name), "--json"]
        assert main(args) == 0
        run = next(iter(json.loads(capsys.readouterr().out)["drafters"].values()))[0]
        raw[name] = run["confidence"]["raw"]
        if name == "shipped":
            assert run["confidence"]["calibrated"] != run["confidence"]["raw"]
    assert raw["shipped"] == raw["bare"]

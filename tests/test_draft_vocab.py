"""The draft vocabulary from the target's rollouts: the most frequent response tokens, coverage per domain
against a direct count, and the saved d2t mapping back to exactly the chosen target ids."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from cli.main import main
from training.draft_vocab import coverage, frequency_d2t, rollout_counts

ROWS = [{"domain": "code", "response_ids": [5, 5, 5, 7, 9]}, {"domain": "chat", "response_ids": [7, 7, 3, 1]},
        {"domain": "math", "response_ids": [5, 2, 2]}]


def test_the_most_frequent_tokens_are_kept_and_map_back_exactly():
    counts = rollout_counts(ROWS, 12)
    assert counts.tolist() == [0, 1, 2, 1, 0, 4, 0, 3, 0, 1, 0, 0]
    d2t = frequency_d2t(counts, 3)
    assert (torch.arange(3) + d2t).tolist() == [2, 5, 7]  # target ids, increasing


def test_coverage_per_domain_equals_a_direct_count():
    d2t = frequency_d2t(rollout_counts(ROWS, 12), 3)
    kept = {2, 5, 7}
    expected = {r["domain"]: sum(t in kept for t in r["response_ids"]) / len(r["response_ids"]) for r in ROWS}
    expected["all"] = sum(t in kept for r in ROWS for t in r["response_ids"]) / 12
    assert coverage(d2t, ROWS, 12) == {k: round(v, 4) for k, v in sorted(expected.items())}


def test_the_cli_saves_d2t_and_reports_held_out_coverage(tmp_path, capsys):
    train, held = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    held.write_text(json.dumps({"domain": "code", "response_ids": [5, 11]}) + "\n")
    out = tmp_path / "d2t.safetensors"
    assert main(["data", "draft-vocab", "--rollouts", str(train), "--held-out", str(held), "--size", "3", "20",
                 "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["coverage"]["3"]["held_out"] == {"all": 0.5, "code": 0.5}
    assert report["coverage"]["20"]["held_out"]["all"] == 1.0  # vocabulary 12 (largest id + 1): everything
    assert (torch.arange(3) + load_file(out)["d2t"]).tolist() == [2, 5, 7]

"""Rollouts for the drafters' training cache: serving temperatures mixed per prompt, resumable from a gzip copy."""

from __future__ import annotations

import json

from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from tests.conftest import make_model
from training.rollouts import RolloutConfig, generate, read

ITEMS = [("chat", f"p{i}", f"What is {i} + {i}?") for i in range(6)]


def _cfg() -> RolloutConfig:
    return RolloutConfig(max_new_tokens=6, batch=4, temperatures=(0.0, 1.0))


def test_temperatures_are_mixed_per_prompt_and_rollouts_resume_from_the_mirror(tmp_path):
    tok = TextTokenizer.from_dir(resolve_model("dspark-target"))
    model = make_model(vocab=tok.vocab_size, layers=1, hidden=32)
    out, mirror = tmp_path / "rollouts.jsonl", tmp_path / "runs" / "rollouts.jsonl.gz"
    generate(model, tok, ITEMS[:4], _cfg(), out, mirror)
    rows = read(out)
    assert {r["temperature"] for r in rows} == {0.0, 1.0}  # both serving temperatures, chosen by prompt id
    again = tmp_path / "fresh" / "rollouts.jsonl"  # a fresh machine: only the committed mirror is there
    again.parent.mkdir()
    generate(model, tok, ITEMS, _cfg(), again, mirror)
    assert read(again)[:4] == rows and len(read(again)) == 6  # the first four not rolled out again
    full = out.parent / "full.jsonl"
    generate(model, tok, ITEMS, _cfg(), full)
    assert read(full) == read(again)  # resuming changes nothing: each prompt's rollout is its own seed's


def test_a_line_cut_by_an_interrupted_write_is_rolled_out_again(tmp_path):
    tok = TextTokenizer.from_dir(resolve_model("dspark-target"))
    model = make_model(vocab=tok.vocab_size, layers=1, hidden=32)
    out = tmp_path / "rollouts.jsonl"
    generate(model, tok, ITEMS[:3], _cfg(), out)
    whole = read(out)
    out.write_text(out.read_text()[:-20])  # the last line cut short
    generate(model, tok, ITEMS[:3], _cfg(), out)
    assert sorted(json.dumps(r) for r in read(out)) == sorted(json.dumps(r) for r in whole)

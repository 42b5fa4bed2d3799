"""The shipped target: loads identically in both loaders and generates per domain, speculation exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from cli.main import main
from services.loader import load_model
from services.registry import MODELS_DIR, list_models
from tests.conftest import full_forward

TARGET = "dspark-target"
DATASETS = Path(__file__).resolve().parents[1] / "benchmarks" / "datasets"


def test_shipped_target_is_listed():
    entries = {e.name: e for e in list_models()}
    assert entries[TARGET].kind == "target"
    assert 15e6 < entries[TARGET].parameters < 40e6
    assert (MODELS_DIR / TARGET / "model.safetensors").stat().st_size <= 40 * 2**20


def test_everything_shipped_fits_300_mb():
    """[2/6]'s budget: the toy targets and their drafters, and Gemma 3 270M's four drafters (the Gemma weights
    themselves come by pip and are not under models/)."""
    total = sum(f.stat().st_size for f in MODELS_DIR.rglob("*") if f.is_file())
    assert total <= 300 * 10**6, f"models/ holds {total / 1e6:.0f} MB"


def test_both_loaders_agree():
    ours = load_model(MODELS_DIR / TARGET, dtype="float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(MODELS_DIR / TARGET, dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (40,))
    logits = full_forward(ours, ids).logits
    with torch.no_grad():
        torch.testing.assert_close(logits, ref(ids[None]).logits[0], atol=1e-4, rtol=1e-4)


def _first_prompts(n: int = 2) -> list[dict]:
    rows = []
    for domain in ("code", "chat", "math"):
        lines = (DATASETS / f"{domain}.jsonl").read_text().splitlines()[:n]
        rows += [{"prompt": json.loads(line)["prompt"]} for line in lines]
    return rows


@pytest.mark.slow
def test_generate_every_domain_and_ngram_is_exact(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in _first_prompts()))
    outs = {}
    for method in ("none", "ngram"):
        args = ["generate", "--model", TARGET, "--prompts", str(prompts), "--max-tokens", "32", "--dtype",
                "float32", "--method", method, "--json"]
        assert main(args) == 0
        outs[method] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all(r["text"].strip() for r in outs["none"])
    assert [r["token_ids"] for r in outs["ngram"]] == [r["token_ids"] for r in outs["none"]]
    assert sum(r["num_draft_tokens"] for r in outs["ngram"]) > 0

"""Target training: runs, resumes where it stopped, exports a checkpoint both loaders agree on."""

from __future__ import annotations

import itertools
import json

import torch
import transformers

from cli.main import main
from services.loader import load_model
from services.registry import list_models, resolve_model
from tests.conftest import full_forward
from training.schedule import warmup_cosine
from training.target import TargetTrainConfig, train


def _config(corpus, tmp_path, tokens: int) -> TargetTrainConfig:
    return TargetTrainConfig(data_dir=corpus["root"] / "data", run_dir=tmp_path / "run", out_dir=tmp_path / "m",
                             hidden=32, layers=2, heads=2, kv_heads=1, ffn=64, seq_len=32, batch_size=4,
                             total_tokens=tokens, warmup_steps=2, eval_every=2, eval_tokens=256,
                             checkpoint_every=1, long_seq_len=64, long_fraction=0.4, export_every=2)


def test_train_resume_export(small_corpus, tmp_path):
    train(_config(small_corpus, tmp_path, 3 * 128), log=lambda _: None)
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]
    assert set(log[1]["val"]) == {"code", "chat", "math"}
    train(_config(small_corpus, tmp_path, 5 * 128), log=lambda _: None)  # same run dir: resumes at step 3
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5]
    # The last 40 % of each run on long windows (same tokens per step): step 3 of the 3-step run, 4-5 of the 5-step one.
    assert [r["seq_len"] for r in log] == [32, 32, 64, 64, 64]
    assert set(log[-1]["val_long"]["code"]) == {"32", "64"}

    out = tmp_path / "m"
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                "tokenizer_config.json", "generation_config.json"}
    ours = load_model(out, dtype="float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (24,))
    logits = full_forward(ours, ids).logits
    with torch.no_grad():
        torch.testing.assert_close(logits, ref(ids[None]).logits[0], atol=1e-4, rtol=1e-4)


def test_registry_lists_and_resolves(small_corpus, tmp_path, monkeypatch, capsys):
    train(_config(small_corpus, tmp_path, 128), log=lambda _: None)
    entry, *pip_installed = list_models(tmp_path)
    assert [e.name for e in pip_installed] == ["gemma-3-270m"]
    assert (entry.name, entry.kind, entry.target) == ("m", "target", None)
    assert entry.parameters == sum(p.numel() for p in load_model(tmp_path / "m").state_dict().values())
    assert resolve_model("m", tmp_path) == tmp_path / "m"
    monkeypatch.setattr("services.registry.MODELS_DIR", tmp_path)
    capsys.readouterr()  # drop the training progress bar
    assert main(["models", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["name"] == "m"


def test_warmup_cosine():
    lrs = [warmup_cosine(s, 100, 10, 1.0) for s in range(100)]
    assert lrs[0] == 0.1 and lrs[9] == 1.0
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    assert abs(lrs[-1] - 0.1) < 1e-3


def test_resume_from_an_export_when_the_run_dir_is_gone(small_corpus, tmp_path):
    """A later session on a fresh machine: no state.pt, only an export; training goes on at its step."""
    import shutil

    cfg = _config(small_corpus, tmp_path, 4 * 128)
    train(cfg, log=lambda _: None)
    export = tmp_path / "kept-export"
    shutil.copytree(tmp_path / "run" / "export", export)  # taken at step 4 (export_every=2)
    assert json.loads((export / "trainer_state.json").read_text())["step"] == 4
    shutil.rmtree(tmp_path / "run")
    from dataclasses import replace

    train(replace(cfg, total_tokens=6 * 128, resume_from=export), log=lambda _: None)
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [5, 6]

"""`dspark generate` and `dspark profile` end to end on a demo model built by the test."""

from __future__ import annotations

import json

import pytest

from cli.main import main
from training.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), vocab_size=600, layers=2)


def _generate(capsys, model_dir, *extra) -> list[dict]:
    code = main(["generate", "--model", str(model_dir), "--dtype", "float32", "--max-tokens", "24", "--json",
                 *extra])
    assert code == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_generate_json_ngram_equals_plain(capsys, model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def main():"}\n\n{"prompt": "import os\\nimport sys\\n"}\n')
    plain = _generate(capsys, model_dir, "--prompts", str(prompts))
    spec = _generate(capsys, model_dir, "--prompts", str(prompts), "--method", "ngram", "--gamma", "3")
    assert len(plain) == len(spec) == 2
    for p, s in zip(plain, spec, strict=True):
        assert {"prompt", "text", "token_ids", "cycles", "tau", "tokens_per_s"} <= set(s)
        assert s["token_ids"] == p["token_ids"] and s["text"] == p["text"]
        assert p["tau"] == 1.0 and p["num_draft_tokens"] == 0
    assert sum(s["num_draft_tokens"] for s in spec) > 0


def test_generate_sampled_is_seeded(capsys, model_dir):
    args = ("--prompt", "class A:", "--temperature", "1.0", "--top-p", "0.9", "--seed", "5", "--method", "ngram")
    a = _generate(capsys, model_dir, *args)[0]
    b = _generate(capsys, model_dir, *args)[0]
    assert a["token_ids"] == b["token_ids"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--prompt", "x", "--policy", "fixed"], "needs a drafting --method"),
        (["--prompt", "x", "--temperature", "-1"], "temperature"),
        (["--prompt", "x", "--method", "ngram", "--gamma", "0"], "--gamma"),
        (["--prompts", "/nonexistent.jsonl"], "nonexistent"),
    ],
)
def test_generate_bad_input(capsys, model_dir, extra, message):
    assert main(["generate", "--model", str(model_dir), *extra]) == 2
    assert message in capsys.readouterr().err


def test_generate_bad_model_dir(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err


def test_profile_json(capsys, model_dir):
    assert main(["profile", "--model", str(model_dir), "--batch-tokens", "1,4,12", "--context", "32",
                 "--tokens-per-request", "4", "--repeats", "2", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert [p["batch_tokens"] for p in table["points"]] == [1, 4, 12]
    assert [p["requests"] for p in table["points"]] == [1, 1, 3]
    assert all(p["sps"] > 0 and p["step_ms"] > 0 for p in table["points"])


def test_generate_chat_wraps_the_prompt(capsys, model_dir):
    (record,) = _generate(capsys, model_dir, "--prompt", "Hi?", "--chat")
    assert record["prompt"] == "<|user|>\nHi?<|end|>\n<|assistant|>\n"


def test_router_role_announces_its_http_address(model_dir):
    """`dspark router` with port 0 writes the address it bound (as the tiers do), so a launcher can find it;
    with its verifier unreachable its /health says 503, naming the tier."""
    import httpx

    from cluster.launcher import start_tiers
    from router.settings import RouterSettings

    settings = RouterSettings(port=0, model=str(model_dir), verifier="127.0.0.1:9", drafter=None, method="none",
                              policy="none", methods=[])
    router, = start_tiers([("router", settings)], timeout_s=60)
    try:
        reply = httpx.get(f"http://{router.address}/health", timeout=10)
        assert reply.status_code == 503 and reply.json()["tiers"] == {"verifier": False}
    finally:
        router.stop()

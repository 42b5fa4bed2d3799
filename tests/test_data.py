"""The corpus pipeline: deterministic splits, clean text, correct worked solutions."""

from __future__ import annotations

import json
import re

import pytest

from services.chat_template import render
from tests.conftest import build_small_corpus
from training.data import math_problems
from training.data.build import split_of
from training.data.rst import api_entries, clean_inline, sections


@pytest.fixture(scope="module")
def built(small_corpus, tmp_path_factory):
    return small_corpus, build_small_corpus(tmp_path_factory.mktemp("again"))


def test_build_is_deterministic(built):
    a, b = built
    assert {k: v["sha256"] for k, v in a["splits"].items()} == {k: v["sha256"] for k, v in b["splits"].items()}
    assert a["tokens"] == b["tokens"]
    assert (a["root"] / "data" / "tokenizer" / "tokenizer.json").read_text() == \
        (b["root"] / "data" / "tokenizer" / "tokenizer.json").read_text()
    assert (a["root"] / "eval" / "math.jsonl").read_text() == (b["root"] / "eval" / "math.jsonl").read_text()


def test_every_domain_has_all_splits_and_prompts(built):
    a, _ = built
    for domain in ("code", "chat", "math"):
        assert a["splits"][f"{domain}.train"]["documents"] > 0
        prompts = [json.loads(line) for line in (a["root"] / "eval" / f"{domain}.jsonl").read_text().splitlines()]
        assert prompts and all(p["domain"] == domain and p["prompt"] for p in prompts)
    chat_prompt = json.loads((a["root"] / "eval" / "chat.jsonl").read_text().splitlines()[0])["prompt"]
    assert chat_prompt.startswith("<|user|>\n") and chat_prompt.endswith("<|assistant|>\n")
    assert sum(v["documents"] for k, v in a["splits"].items() if k.startswith("math")) == 200


def test_split_is_a_pure_function_of_id_and_seed():
    splits = [split_of(f"doc{i}", 0) for i in range(4000)]
    assert splits == [split_of(f"doc{i}", 0) for i in range(4000)]
    assert 0.87 < splits.count("train") / 4000 < 0.93
    assert splits != [split_of(f"doc{i}", 1) for i in range(4000)]


def test_math_solutions_are_correct():
    ops = {"×": lambda a, b: a * b, "+": lambda a, b: a + b, "−": lambda a, b: a - b, "÷": lambda a, b: a / b}
    step = re.compile(r"(\d+(?:\.\d+)?) ([×+−÷]) (\d+(?:\.\d+)?) = (\d+)")
    for seed in range(300):
        question, solution = math_problems.problem(seed)
        checks = step.findall(solution)
        assert checks, solution
        for a, op, b, c in checks:
            assert ops[op](float(a), float(b)) == float(c), (question, solution)
        last = int(checks[-1][3])
        assert solution.endswith(f"Answer: {last}")


def test_rst_cleaning():
    text = "Title\n=====\n\nUse :func:`os.path.join` and ``x + 1``, see `docs <https://x.org>`_.\n\n" \
           ".. index:: single: hidden\n   nothing here\n\nMore **bold** text::\n\n   code()\n"
    (sec,) = sections(text)
    assert sec.title == "Title"
    assert sec.body == "Use os.path.join and x + 1, see docs.\n\nMore bold text:\n\n   code()"
    assert clean_inline(":mod:`the pdb module <pdb>`") == "pdb"
    (entry,) = api_entries(".. module:: os\n\n.. function:: getcwd()\n\n   Return the *current* directory.\n")
    assert (entry.kind, entry.signature, entry.module, entry.body) == ("function", "getcwd()", "os",
                                                                       "Return the current directory.")


def test_chat_render():
    msgs = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]
    assert render(msgs) == "<|user|>\nQ?<|end|>\n<|assistant|>\nA.<|end|>\n"
    assert render(msgs[:1], add_generation_prompt=True) == "<|user|>\nQ?<|end|>\n<|assistant|>\n"
    with pytest.raises(ValueError):
        render([{"role": "robot", "content": "x"}])


def test_tokenizer_round_trips_every_domain(small_corpus):
    from services.tokenizer import TextTokenizer

    tok = TextTokenizer.from_dir(small_corpus["root"] / "data" / "tokenizer")
    assert tok.bos_token_id is not None
    for domain in ("code", "chat", "math"):
        lines = (small_corpus["root"] / "data" / f"{domain}.val.jsonl").read_text().splitlines()[:20]
        for line in lines:
            text = json.loads(line)["text"].replace("<|end|>", "")  # specials are dropped on decode
            for special in ("<|user|>", "<|assistant|>"):
                text = text.replace(special, "")
            assert tok.decode(tok.encode(text)) == text

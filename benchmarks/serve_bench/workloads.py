"""What `dspark bench` sends: prompts from the shipped eval sets, or random token ids of fixed lengths.

A workload is a fixed, seeded list of prompts; request i of every arm and every load gets prompt
i mod len, so the arms' outputs can be compared request by request (the losslessness gate).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

DATASETS = Path(__file__).resolve().parents[1] / "datasets"
EVAL_SETS = ("code", "math", "chat")
# The structured-output arm (`json`): every request constrained to this schema (vLLM's `structured_outputs`), so
# the grammar's cost and its effect on acceptance show in the same bench as the free arms.
JSON_ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 160},
                                                "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
               "required": ["answer", "confidence"], "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    prompts: list[str | list[int]]  # text, or token ids (random)
    ignore_eos: bool = False  # random shapes run to max_tokens, as vLLM's `random` dataset does
    extra: dict = field(default_factory=dict)  # request fields every request carries (the `json` arm's constraint)

    def prompt(self, i: int) -> str | list[int]:
        return self.prompts[i % len(self.prompts)]


def eval_set(name: str, limit: int | None = None) -> list[str]:
    path = DATASETS / f"{name}.jsonl"
    if not path.is_file():
        raise ValueError(f"no eval set {name!r} (have: {', '.join(EVAL_SETS)})")
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    return prompts[:limit]


def load_workload(name: str, vocab_size: int = 8192, input_len: int = 128, seed: int = 0,
                  count: int = 64) -> Workload:
    """`code`, `math`, `chat`, `mix` (the three interleaved), `json` (the chat and math prompts, each answer
    constrained to `JSON_ANSWER`) or `random` (`count` prompts of `input_len` token ids, drawn from the vocabulary
    but its first 16 ids, where special tokens live)."""
    if name in EVAL_SETS:
        return Workload(name, list(eval_set(name)))
    if name == "mix":
        sets = [eval_set(n) for n in EVAL_SETS]
        return Workload(name, [p for trio in zip(*sets, strict=False) for p in trio])
    if name == "json":
        prompts = [p for pair in zip(eval_set("chat"), eval_set("math"), strict=False) for p in pair]
        return Workload(name, prompts, extra={"structured_outputs": {"json": JSON_ANSWER}})
    if name == "random":
        rng = random.Random(seed)
        return Workload(name, [[rng.randrange(16, vocab_size) for _ in range(input_len)] for _ in range(count)],
                        ignore_eos=True)
    raise ValueError(f"unknown workload {name!r}: code, math, chat, mix, json or random")

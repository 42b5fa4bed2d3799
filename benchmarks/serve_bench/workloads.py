"""What `dspark bench` sends: prompts from the shipped eval sets, or random token ids of fixed lengths.

A workload is a fixed, seeded list of prompts; request i of every arm and every load gets prompt
i mod len, so the arms' outputs can be compared request by request (the losslessness gate).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

DATASETS = Path(__file__).resolve().parents[1] / "datasets"
EVAL_SETS = ("code", "math", "chat")


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    prompts: list[str | list[int]]  # text, or token ids (random)
    ignore_eos: bool = False  # random shapes run to max_tokens, as vLLM's `random` dataset does

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
    """`code`, `math`, `chat`, `mix` (the three interleaved) or `random` (`count` prompts of `input_len`
    token ids, drawn from the vocabulary but its first 16 ids, where special tokens live)."""
    if name in EVAL_SETS:
        return Workload(name, list(eval_set(name)))
    if name == "mix":
        sets = [eval_set(n) for n in EVAL_SETS]
        return Workload(name, [p for trio in zip(*sets, strict=False) for p in trio])
    if name == "random":
        rng = random.Random(seed)
        return Workload(name, [[rng.randrange(16, vocab_size) for _ in range(input_len)] for _ in range(count)],
                        ignore_eos=True)
    raise ValueError(f"unknown workload {name!r}: code, math, chat, mix or random")

"""What structured output costs a verify step: constrained vs unconstrained greedy decoding of the same prompts, in
the same run, at batch 1 and 16 — the grammar's share of a step (the masks of every row, the commits) and tokens/s.

    python -m benchmarks.grammar_cost [--model gemma-3-270m] [--dtype auto] [--tokens 48] [--threads 2]

Prints one JSON object; the CPU (model name and bf16 flags) is recorded beside the figures.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.harness import cpu_model
from in_process.generation import GenerationRequest, InProcessRouter
from services.loader import load_model
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import Grammar, SamplingParams
from verifier_worker import engine as engine_module
from verifier_worker.engine import Engine, EngineConfig

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                    "maxItems": 4},
                                           "year": {"type": "integer"}},
          "required": ["name", "tags", "year"], "additionalProperties": False}
QUESTIONS = ["Describe the Python language as JSON.", "Give a JSON record of a famous book.",
             "A JSON object for a city you know.", "Describe a programming tool as JSON."]


def run(model, tok, batch: int, tokens: int, grammar: Grammar | None) -> dict:
    engine = Engine(model, EngineConfig(num_slots=batch, max_len=512, max_batch_tokens=4096))
    prompts = [tok.chat_ids([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]) for i in range(batch)]
    spent = [0.0]
    masks = engine_module.grammar_masks

    def timed(*args):
        t0 = time.perf_counter()
        out = masks(*args)
        spent[0] += time.perf_counter() - t0
        return out

    reqs = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=tokens, grammar=grammar)) for i, p in
            enumerate(prompts)]
    InProcessRouter(engine).generate(reqs[:1])  # warm
    spent[0] = 0.0
    engine_module.grammar_masks = timed
    try:
        t0 = time.perf_counter()  # the same engine as the warm-up: its grammar tokenizer is built (a start-up cost)
        out = InProcessRouter(engine).generate(
            [GenerationRequest(f"s{r.request_id}", r.prompt_ids, r.params) for r in reqs])
        wall = time.perf_counter() - t0
    finally:
        engine_module.grammar_masks = masks
    emitted = sum(len(r.token_ids) for r in out)
    return {"tokens": emitted, "wall_s": round(wall, 3), "tok_per_s": round(emitted / wall, 1),
            "grammar_s": round(spent[0], 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    model, tok = load_model(model_dir, args.dtype), TextTokenizer.from_dir(model_dir)
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    report = {"model": args.model, "dtype": str(model.dtype), "cpu": cpu_model(), "threads": args.threads}
    for batch in (1, 16):
        plain = run(model, tok, batch, args.tokens, None)
        constrained = run(model, tok, batch, args.tokens, grammar)
        report[f"batch{batch}"] = {"plain": plain, "constrained": constrained,
                                   "grammar_share_of_wall": round(constrained["grammar_s"] / constrained["wall_s"], 4),
                                   "tok_per_s_ratio": round(constrained["tok_per_s"] / plain["tok_per_s"], 3)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

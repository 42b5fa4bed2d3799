"""What drafting under the grammar buys: the same constrained requests (a JSON schema) drafted with and without
the grammar (drafter_worker/constrained.py), in the same run — τ (tokens a cycle), accepted drafts a cycle, and
the share of blocks holding a draft the grammar forbids. Greedy output is checked identical between the two.

    python -m benchmarks.constrained_drafting [--model dspark-target-v2] [--drafters dspark,dflash,eagle3]
        [--temperature 0,1] [--prompts 8] [--tokens 64] [--out FILE]

Prints one JSON object; the CPU (model name and bf16 flags) is recorded beside the figures.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.grammar_cost import QUESTIONS, SCHEMA
from benchmarks.harness import cpu_model
from drafter_worker.checkpoint import drafter_config, load_drafter
from drafter_worker.drafter import Drafter
from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.grammar import GrammarTokenizer
from services.loader import load_model
from services.registry import model_name, resolve_model
from services.tokenizer import TextTokenizer
from services.types import Grammar, SamplingParams
from verifier_worker.engine import Engine, EngineConfig


def _forbidden(gt: GrammarTokenizer, grammar: Grammar, blocks: list[tuple[list[int], list[int]]]) -> float:
    """The share of blocks with a draft the grammar forbids after the committed output and the drafts before it."""
    bad = 0
    for output, drafts in blocks:
        walker = gt.start(grammar)
        walker.commit(output)
        bad += not all(walker.matcher.consume_token(t) for t in drafts)
    return bad / max(1, len(blocks))


def arm(model, drafter, tok, gt, grammar, temperature: float, prompts: int, tokens: int, constrained: bool) -> dict:
    committed: dict[str, list[int]] = {}
    blocks: list[tuple[list[int], list[int]]] = []

    def observe(rid, block, out):
        if block:
            blocks.append((list(committed[rid]), list(block.tokens)))

    def on_tokens(rid, new):
        committed.setdefault(rid, []).extend(new)

    reqs = [GenerationRequest(f"r{i}", tok.chat_ids([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]),
                              SamplingParams(temperature=temperature, seed=i, max_tokens=tokens, grammar=grammar),
                              stop_token_ids=tok.eos_token_ids) for i in range(prompts)]
    engine = Engine(model, EngineConfig(num_slots=prompts, max_len=512, max_batch_tokens=4096))
    router = InProcessRouter(engine, drafter, Policy.FIXED, drafter.model.dconfig.block_size, observer=observe,
                         constrained_drafting=constrained)
    out = router.generate(reqs, on_tokens)
    cycles = sum(r.cycles for r in out)
    return {"tau": round(sum(r.cycle_tokens for r in out) / cycles, 3),
            "accepted_per_cycle": round(sum(r.accepted_tokens for r in out) / cycles, 3),
            "blocks_with_a_forbidden_draft": round(_forbidden(gt, grammar, blocks), 3),
            "outputs": [r.token_ids for r in out]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dspark-target-v2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--drafters", default="dspark,dflash,eagle3")
    p.add_argument("--temperature", default="0,1")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out", help="also write the JSON report here")
    args = p.parse_args()
    name = model_name(args.model)
    taps = drafter_config(resolve_model(f"{name}-dspark")).tap_layers
    model = load_model(resolve_model(args.model), args.dtype, "cpu", tap_layers=taps)
    tok = TextTokenizer.from_dir(resolve_model(args.model))
    gt = GrammarTokenizer(model.source_dir, model.config.vocab_size)
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    report = {"model": name, "dtype": args.dtype, "cpu": cpu_model(), "prompts": args.prompts,
              "max_tokens": args.tokens, "arms": {}}
    for method in args.drafters.split(","):
        draft_model, calibration = load_drafter(f"{name}-{method}", model, args.dtype)
        for t in (float(x) for x in args.temperature.split(",")):
            runs = {c: arm(model, Drafter(draft_model, calibration), tok, gt, grammar, t, args.prompts, args.tokens, c)
                    for c in (True, False)}
            if t == 0:
                assert runs[True]["outputs"] == runs[False]["outputs"], f"{method}: greedy outputs differ"
            report["arms"][f"{method} T={t:g}"] = {
                "constrained": {k: v for k, v in runs[True].items() if k != "outputs"},
                "unconstrained": {k: v for k, v in runs[False].items() if k != "outputs"}}
            print(method, t, report["arms"][f"{method} T={t:g}"], flush=True)
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()

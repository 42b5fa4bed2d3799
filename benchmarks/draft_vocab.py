"""A frequency-ranked draft vocabulary for the shipped EAGLE-3 drafter: τ lost, draft time saved, tokens/s.

Token counts come from the chat / code / math training text (build/data-v2 when built, else the eval
prompts) tokenized with the shipped target's tokenizer; the Vd most frequent tokens form each draft
vocabulary (`training/draft_vocab.py`). In one run, batch 1, greedy, fixed γ, rounds alternating between
plain decoding and each Vd: tokens/s against plain, τ, and the drafter's own time per cycle.

    python benchmarks/draft_vocab.py [--sizes 8192,4096,2048,1024] [--rounds 3] [--tokens 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.harness import DATASETS, cpu_model, eval_prompts
from drafter_worker.checkpoint import drafter_config, load_drafter
from drafter_worker.drafter import Drafter
from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.loader import load_model, native_bf16
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from training.draft_vocab import frequency_d2t, reduce_vocab
from verifier_worker.engine import Engine, EngineConfig

CORPUS = Path("build/data-v2")


def token_counts(tok: TextTokenizer, vocab: int, max_chars: int) -> tuple[torch.Tensor, str]:
    files = sorted(CORPUS.glob("*.train.jsonl")) or sorted(DATASETS.glob("*.jsonl"))
    counts = torch.zeros(vocab, dtype=torch.long)
    for path in files:
        text, size = [], 0
        for line in path.read_text().splitlines():
            row = json.loads(line)
            piece = row.get("text") or row.get("prompt") or "\n".join(m["content"] for m in row.get("messages", []))
            text.append(piece)
            size += len(piece)
            if size > max_chars:
                break
        counts += torch.bincount(torch.tensor(tok.encode("\n".join(text))), minlength=vocab)[:vocab]
    return counts, ", ".join(p.name for p in files)


def run(engine, proposer, policy, gamma, ids, tokens) -> dict:
    router = InProcessRouter(engine, proposer, policy, gamma)
    timed = {"draft_s": 0.0}
    if proposer is not None:
        propose = proposer.propose

        def clocked(*a, **k):
            t0 = time.perf_counter()
            try:
                return propose(*a, **k)
            finally:
                timed["draft_s"] += time.perf_counter() - t0
        proposer.propose = clocked
    started = time.perf_counter()
    results = router.generate([GenerationRequest(f"p{i}", p, SamplingParams(max_tokens=tokens))
                               for i, p in enumerate(ids)])
    wall, cycles = time.perf_counter() - started, sum(r.cycles for r in results)
    if proposer is not None:
        proposer.propose = propose
    return {"tok_s": sum(len(r.token_ids) for r in results) / wall,
            "tau": sum(r.cycle_tokens for r in results) / cycles,
            "draft_ms_per_cycle": 1000 * timed["draft_s"] / cycles}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="8192,4096,2048,1024")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--max-chars", type=int, default=2_000_000, help="text per corpus file for the counts")
    p.add_argument("--json", default="benchmarks/results/draft-vocab-cpu.json")
    args = p.parse_args()
    target_dir, drafter_dir = resolve_model("dspark-target"), resolve_model("dspark-target-eagle3")
    tok = TextTokenizer.from_dir(target_dir)
    taps = drafter_config(drafter_dir).tap_layers
    target = load_model(target_dir, "auto", None, tap_layers=taps)
    full, calibration = load_drafter(drafter_dir, target, target.dtype)
    counts, source = token_counts(tok, target.config.vocab_size, args.max_chars)
    sizes = [int(s) for s in args.sizes.split(",")]
    arms = {vd: Drafter(full if vd >= target.config.vocab_size else reduce_vocab(full, frequency_d2t(counts, vd)),
                        calibration) for vd in sizes}
    ids = eval_prompts(tok, DATASETS, args.prompts)
    engine = Engine(target, EngineConfig(num_slots=2, max_len=1024))
    run(engine, None, Policy.NONE, 1, ids[:1], 8)  # warm-up
    per: dict = {"plain": []} | {vd: [] for vd in sizes}
    for _ in range(args.rounds):
        per["plain"].append(run(engine, None, Policy.NONE, 1, ids, args.tokens))
        for vd, drafter in arms.items():
            per[vd].append(run(engine, drafter, Policy.FIXED, args.gamma, ids, args.tokens))
    plain = statistics.median(r["tok_s"] for r in per["plain"])
    rows = []
    for vd in sizes:
        med = {k: statistics.median(r[k] for r in per[vd]) for k in ("tok_s", "tau", "draft_ms_per_cycle")}
        coverage = float(counts.double().topk(vd).values.sum() / counts.sum())
        rows.append({"draft_vocab": vd, "corpus_coverage": round(coverage, 4),
                     "x_plain": round(med["tok_s"] / plain, 3), **{k: round(v, 3) for k, v in med.items()}})
        print(f"Vd {vd:>5}: corpus coverage {coverage:6.1%}  τ {med['tau']:.2f}  draft {med['draft_ms_per_cycle']:.2f} "
              f"ms/cycle  {med['tok_s']:.0f} tok/s = {med['tok_s'] / plain:.2f} × plain")
    meta = {"cpu": cpu_model(), "bf16_native": native_bf16(target.device), "dtype": str(target.dtype), "threads":
            torch.get_num_threads(), "gamma": args.gamma, "tokens": args.tokens, "prompts": len(ids),
            "counts_from": source, "plain_tok_s": round(plain, 1)}
    Path(args.json).write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()

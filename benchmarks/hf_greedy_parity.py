"""fp32 greedy of dspark's engine against transformers' `generate` on the same checkpoint, prompt by prompt, over
the evaluation prompt sets: how many prompts agree token for token, and where the others first diverge.

    python benchmarks/hf_greedy_parity.py --model gemma-3-270m [--per-domain 24] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from benchmarks.harness import cpu_model
from in_process.generation import GenerationRequest, InProcessRouter
from services.loader import load_model
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from verifier_worker.engine import Engine, EngineConfig

DATASETS = Path(__file__).resolve().parent / "datasets"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--per-domain", type=int, default=24)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    model_dir = resolve_model(args.model)
    tok = TextTokenizer.from_dir(model_dir)
    prompts = []
    for domain in ("code", "chat", "math"):
        lines = (DATASETS / f"{domain}.jsonl").read_text().splitlines()[: args.per_domain]
        prompts += [(domain, tok.encode(json.loads(line)["prompt"])) for line in lines]
    engine = Engine(load_model(model_dir, "float32"), EngineConfig(num_slots=16, max_len=1024))
    reqs = [GenerationRequest(f"p{i}", ids, SamplingParams(max_tokens=args.tokens))
            for i, (_, ids) in enumerate(prompts)]
    ours = [r.token_ids for r in InProcessRouter(engine).generate(reqs)]
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    diverged = []
    for (domain, ids), got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False,
                               eos_token_id=None)[0, len(ids):].tolist()
        same = next((k for k, (a, b) in enumerate(zip(got, out, strict=False)) if a != b), min(len(got), len(out)))
        if got != out[: len(got)]:
            diverged.append({"domain": domain, "first_divergence": same})
    print(json.dumps({"model": args.model, "cpu": cpu_model(), "prompts": len(prompts), "tokens": args.tokens,
                      "identical": len(prompts) - len(diverged), "diverged": diverged}, indent=1))


if __name__ == "__main__":
    main()

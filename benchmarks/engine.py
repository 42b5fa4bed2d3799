"""Engine benchmark: plain decoding tokens/s, verify cost forward(1+γ)/forward(1), greedy identity in the serving dtype.

Runs on a random-weight Llama of the size the project ships (default d=512, 8 layers, vocab 8192,
about 35M parameters). Every ratio is against a baseline measured in the same run; forward
timings interleave all γ round by round so a slow spell of this noisy VM hits them alike.

    python benchmarks/engine.py [--batches 1,4,16] [--gammas 1,3,7,15] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from benchmarks.harness import (
    Stopping,
    alternate,
    forward_ms,
    generate_rate,
    load_target,
    machine,
    random_prompts,
    write_json,
)
from router.scheduling.policy import Policy
from services.loader import resolve_dtype
from services.model import CausalLM
from services.types import DraftBlock
from training.tiny_model import random_model, tiny_config
from verifier_worker.engine import Engine, EngineConfig
from verifier_worker.kv_cache import KVCache
from verifier_worker.profile import time_forward


def build_model(args) -> torch.nn.Module:
    if args.model:
        model = load_target(args.model, args.dtype).model
        print(f"model: {args.model}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
        return model
    cfg = tiny_config(args.vocab, eos_id=0, layers=args.layers, hidden=args.hidden)
    model = random_model(cfg, seed=0, std=0.05)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: d={args.hidden} layers={args.layers} vocab={args.vocab} params={params / 1e6:.1f}M")
    return model.to(resolve_dtype(args.dtype))


def verify_cost(model, batches, gammas, context, rounds) -> list[dict]:
    """Median ms of one forward with (1+γ) new tokens per request, interleaved over γ."""
    rows = []
    for b in batches:
        ms = forward_ms(model, [1] + [1 + g for g in gammas], context, rounds, batch=b)
        rows += [{"batch": b, "gamma": q - 1, "ms": t, "ratio_vs_decode": round(t / ms[1], 3)} for q, t in ms.items()]
    return rows


def drafter_block_ratio(model, context: int, rounds: int) -> dict:
    """Target forward(1) against a one-layer model of the same width drafting a block of 8 (what a DFlash /
    DSpark drafter costs per cycle): speculation can only pay when the first is several times the second."""
    drafter = CausalLM(dataclasses.replace(model.config, num_hidden_layers=1)).to(model.dtype).eval()
    caches = [KVCache(m.config, 1, context + 8, m.dtype, m.device) for m in (model, drafter)]
    times = alternate({"target_1": lambda: time_forward(model, caches[0], [1], context, 1)[0],
                       "drafter_8": lambda: time_forward(drafter, caches[1], [8], context, 1)[0]}, rounds, warm_up=2)
    target, block = (statistics.median(times[k]) for k in ("target_1", "drafter_8"))
    return {"target_forward_1_ms": round(1000 * target, 3), "drafter_block_8_ms": round(1000 * block, 3),
            "ratio": round(target / block, 2)}


def plain_decode(model, batches, prompt_len, new_tokens) -> list[dict]:
    rows = []
    for b in batches:
        engine = Engine(model, EngineConfig(num_slots=b, max_len=prompt_len + new_tokens + 16, max_batch_tokens=4096))
        ids = random_prompts(model.config.vocab_size, b, prompt_len, seed=b)
        generate_rate(engine, ids[:1], Stopping(new_tokens))  # warm-up
        rate = generate_rate(engine, ids, Stopping(new_tokens), batch=b)
        rows.append({"batch": b, "tokens": rate.tokens, "tokens_per_s": round(rate.tokens_per_s, 1),
                     "per_request_tokens_per_s": round(rate.tokens_per_s / b, 1)})
    return rows


class _OracleWithErrors:
    """Proposes the plain-greedy continuation with one wrong token in four: exercises accept and reject."""

    def __init__(self, answers, vocab):
        self.answers, self.vocab, self.calls = answers, vocab, 0

    def propose(self, contexts, gamma, params=None):
        out = {}
        for rid, ctx in contexts.items():
            tokens = list(self.answers[rid][len(ctx) : len(ctx) + gamma])
            self.calls += 1
            if tokens and self.calls % 4 == 0:
                tokens[-1] = (tokens[-1] + 1) % self.vocab
            out[rid] = DraftBlock(tokens)
        return out

    def commit(self, request_id, feature_start, features):
        pass  # it reads no target features

    def release(self, request_id):
        pass


def greedy_identity(model, prompts, new_tokens, gamma) -> dict:
    """How often speculative greedy equals plain greedy in the serving dtype (tokens and whole outputs)."""
    def run(proposer, policy):
        engine = Engine(model, EngineConfig(num_slots=8, max_len=512, max_batch_tokens=512))
        return generate_rate(engine, prompts, Stopping(new_tokens), proposer, policy, gamma, batch=len(prompts))

    plain = run(None, Policy.NONE)
    answers = {f"p{i}": p + out for i, (p, out) in enumerate(zip(prompts, plain.outputs, strict=True))}
    spec = run(_OracleWithErrors(answers, model.config.vocab_size), Policy.FIXED)
    pairs = list(zip(plain.outputs, spec.outputs, strict=True))
    return {"outputs": len(pairs), "identical_outputs": sum(p == s for p, s in pairs),
            "tokens_before_first_divergence": sum(_common_prefix(p, s) for p, s in pairs),
            "tokens": plain.tokens, "tau": round(spec.tau, 3),
            "plain_tokens_per_s": round(plain.tokens_per_s, 1), "spec_tokens_per_s": round(spec.tokens_per_s, 1)}


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a shipped model or model directory (default: a random-weight model)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batches", default="1,2,4,8,16")
    p.add_argument("--gammas", default="1,3,7,15")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="auto (bf16 where native, else fp32), bfloat16 or float32")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(x) for x in args.batches.split(",")]
    gammas = [int(x) for x in args.gammas.split(",")]
    model = build_model(args)
    meta = {**machine(), **vars(args), "dtype": str(model.dtype).removeprefix("torch.")}

    decode = plain_decode(model, batches, prompt_len=128, new_tokens=args.decode_tokens)
    print(f"\nplain decoding (engine, {meta['dtype']}, prompt 128):")
    for r in decode:
        print(f"  batch {r['batch']:>3}: {r['tokens_per_s']:8.1f} tok/s total, "
              f"{r['per_request_tokens_per_s']:7.1f} per request")

    verify = verify_cost(model, batches, gammas, args.context, args.rounds)
    print(f"\nverify cost, forward(1+γ) / forward(1), context {args.context}, "
          f"median of {args.rounds} interleaved rounds:")
    for b in batches:
        cells = [f"γ={r['gamma']}: {r['ms']:.2f} ms ({r['ratio_vs_decode']:.2f}x)" for r in verify if r["batch"] == b]
        print(f"  batch {b:>3}: " + ", ".join(cells))

    ratio = drafter_block_ratio(model, args.context, args.rounds)
    print(f"\ntarget forward(1) {ratio['target_forward_1_ms']:.2f} ms vs one-layer drafter block of 8 "
          f"{ratio['drafter_block_8_ms']:.2f} ms: {ratio['ratio']:.2f}x")

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (16 + 8 * i,), generator=g).tolist() for i in range(8)]
    identity = [greedy_identity(model, prompts, 64, 4)]
    print(f"\n{meta['dtype']} speculative greedy vs plain greedy, 8 prompts x 64 tokens, oracle drafter with errors:")
    for r in identity:
        print(f"  {r['identical_outputs']}/{r['outputs']} outputs identical, "
              f"{r['tokens_before_first_divergence']}/{r['tokens']} tokens before the first divergence, "
              f"τ={r['tau']}, plain {r['plain_tokens_per_s']} tok/s, speculative {r['spec_tokens_per_s']} tok/s")
    write_json(args.json, {"meta": meta, "plain_decode": decode, "verify_cost": verify, "drafter_block": ratio,
                           "greedy_identity": identity})


if __name__ == "__main__":
    main()

"""The engine at the machine's limit: eager against compiled steps, plain and speculative, in one run.

For the shipped target (or any model directory), in the default dtype of this machine, batch 1 and 8,
greedy, on the eval prompts of benchmarks/datasets/v2 (those of acceptance-v2.md; `--datasets-dir`), each
request stopping at the model's end of sequence as a user's would (`--ignore-eos`: always `--tokens`):

- plain decoding tokens/s per mode (eager, compiled), rounds alternating between the modes;
- forward(n) / forward(1) for n = 1..64 new tokens after 256 cached, per mode;
- each shipped drafter (or `--drafters arm=dir`) at fixed γ, tokens/s against plain decoding of the same mode
  in alternating rounds, batch 1, greedy or at `--temperature` (seeded), and what its block costs against a
  target forward(1) (compiled mode also compiles a block drafter's greedy blocks; one warm-up request pays
  that compile before timing).

Every figure is a ratio against a baseline measured in this run; the JSON also carries the CPU model and
whether bf16 is native. `python benchmarks/engine_speed.py [--model dspark-target] [--json out.json]`
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.harness import (
    DATASETS,
    DRAFTERS,
    FORWARD_SIZES,
    Stopping,
    alternate,
    drafter_dirs,
    eval_prompts,
    forward_ms,
    generate_rate,
    load_target,
    machine,
    medians,
    write_json,
)
from drafter_worker.checkpoint import load_drafter
from drafter_worker.drafter import Drafter
from router.scheduling.policy import Policy
from verifier_worker.engine import Engine, EngineConfig
from verifier_worker.profile import profile_sps


class TimedProposer:
    """A drafter with the wall time of its calls (`propose`: a block; `commit`: folding features) summed, so a
    run can say what a block costs against a target step."""

    def __init__(self, drafter: Drafter):
        self.drafter, self.blocks, self.propose_s, self.commit_s = drafter, 0, 0.0, 0.0

    def propose(self, contexts, gamma, params):
        started = time.perf_counter()
        blocks = self.drafter.propose(contexts, gamma, params)
        self.propose_s += time.perf_counter() - started
        self.blocks += len(blocks)
        return blocks

    def commit(self, request_id, feature_start, features):
        started = time.perf_counter()
        self.drafter.commit(request_id, feature_start, features)
        self.commit_s += time.perf_counter() - started

    def release(self, request_id):
        self.drafter.release(request_id)

    def per_block_ms(self) -> dict[str, float]:
        n = max(1, self.blocks)
        return {"propose_ms": round(1000 * self.propose_s / n, 3), "commit_ms": round(1000 * self.commit_s / n, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dspark-target")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request at most")
    p.add_argument("--datasets-dir", type=Path, default=DATASETS, help="code/math/chat.jsonl eval prompts")
    p.add_argument("--ignore-eos", action="store_true", help="generate --tokens past the end of sequence")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--temperature", type=float, default=0.0, help="of the speculative arms and their plain rounds")
    p.add_argument("--policy", default="fixed", choices=["fixed", "threshold", "dspark"],
                   help="verify length of the speculative arms (mtp1: always its one draft); dspark plans against "
                        "the engine's SPS profile, measured at start")
    p.add_argument("--drafters", default=",".join(DRAFTERS),
                   help="comma list of arms (the model's shipped drafters) or arm=directory ('' for none)")
    p.add_argument("--json")
    args = p.parse_args()
    modes = args.modes.split(",")
    target = load_target(args.model, args.dtype, drafters=drafter_dirs(args.drafters, args.model))
    model, tok = target.model, target.tokenizer
    ids = eval_prompts(tok, args.datasets_dir, args.prompts)
    stopping = Stopping(args.tokens, () if args.ignore_eos else tok.eos_token_ids)
    meta = {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, **machine(),
            "dtype": target.dtype_name}
    print(json.dumps(meta))
    engines = {}
    for mode in modes:
        started = time.perf_counter()
        engines[mode] = Engine(model, EngineConfig(num_slots=8, max_len=1024, compile=mode == "compiled"))
        print(f"{mode}: engine ready in {time.perf_counter() - started:.1f} s", flush=True)
    # the engine at a constant batch: every request runs its --tokens (no end of sequence)
    plain_arms = {(mode, batch): (lambda m=mode, b=batch: generate_rate(
                      engines[m], ids if b == 1 else (ids * 8)[:8], Stopping(args.tokens), batch=b).tokens_per_s)
                  for mode in modes for batch in (1, 8)}
    plain = medians(alternate(plain_arms, args.rounds, warm_up=0))
    results = {"meta": meta, "plain": {}, "forward_ms": {}, "speculative": {}}
    for mode in modes:
        results["plain"][mode] = {b: plain[(mode, b)] for b in (1, 8)}
        curve = forward_ms(engines[mode].forward, FORWARD_SIZES, 256, 10)
        results["forward_ms"][mode] = curve
        print(f"{mode}: plain b1 {results['plain'][mode][1]} tok/s, b8 {results['plain'][mode][8]} tok/s; "
              f"forward(8)/forward(1) {curve[8] / curve[1]:.2f}; forward(n) ms {curve}", flush=True)
    policy = Policy(args.policy)
    sps = None
    if policy is Policy.DSPARK:
        sps = [(point.batch_tokens, point.step_ms) for point in profile_sps(model)]
        results["sps"] = sps
    for name, directory in target.drafters.items():
        draft_model, calibration = load_drafter(directory, model, args.dtype)
        for mode in modes:
            drafter = Drafter(draft_model, calibration, compile=mode == "compiled")
            gamma, arm = (1, Policy.FIXED) if name == "mtp1" else (args.gamma, policy)
            t = args.temperature
            generate_rate(engines[mode], ids[:1], Stopping(16), drafter, arm, gamma, sps=sps)  # warm-up, compile
            timed = TimedProposer(drafter)
            first = generate_rate(engines[mode], ids, stopping, timed, arm, gamma, temperature=t, sps=sps)
            plain_run = dict(engine=engines[mode], ids=ids, stopping=stopping, temperature=t)
            spec_run = dict(plain_run, proposer=drafter, policy=arm, gamma=gamma, sps=sps)
            samples = alternate({"plain": lambda k=plain_run: generate_rate(**k).tokens_per_s,
                                 "spec": lambda k=spec_run: generate_rate(**k).tokens_per_s}, args.rounds, warm_up=0)
            base, tps = statistics.median(samples["plain"]), statistics.median(samples["spec"])
            block = timed.per_block_ms()
            block_x = block["propose_ms"] / results["forward_ms"][mode][1]
            results["speculative"].setdefault(name, {})[mode] = {"tokens_per_s": round(tps, 1),
                                                                 "plain_tokens_per_s": round(base, 1),
                                                                 "x_plain": round(tps / base, 2), **block,
                                                                 "block_x_step": round(block_x, 2),
                                                                 "tau": round(first.tau, 3), "tokens": first.tokens}
            print(f"{name} {mode}: {tps:.1f} tok/s against plain {base:.1f} in the same rounds = {tps / base:.2f} x; "
                  f"τ {first.tau:.2f} over {first.tokens} tokens; a block {block} = {block_x:.2f} x a target "
                  f"forward(1)", flush=True)
    if len(modes) > 1:
        results["compiled_x_eager"] = {b: round(results["plain"]["compiled"][b] / results["plain"]["eager"][b], 2)
                                       for b in (1, 8)}
        print("compiled / eager plain decoding:", results["compiled_x_eager"])
    write_json(args.json, results)


if __name__ == "__main__":
    main()

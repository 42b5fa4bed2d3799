"""The prepared device check: one short run on an accelerator that prints one JSON object.

Load the shipped target (and every shipped drafter) on the device in its default dtype; for the eager and
the compiled step: plain greedy, then each drafter's speculative greedy, which must give the same tokens
(`identical`), with tokens/s against plain decoding of the same mode; the SPS(B) profile of the compiled
step. Sized to finish in well under 8 minutes on one GPU (compiles included). On a machine without CUDA it
runs on the CPU, which is how the test suite keeps it working (`tests/test_gpu_check.py`).

    python benchmarks/gpu_check.py [--device cuda] [--prompts 4] [--tokens 48] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.harness import (
    DATASETS,
    DRAFTERS,
    Stopping,
    eval_prompts,
    generate_rate,
    load_target,
    machine,
    write_json,
)
from drafter_worker.checkpoint import load_drafter
from drafter_worker.drafter import Drafter
from router.scheduling.policy import Policy
from services.loader import resolve_device
from services.registry import resolve_model
from verifier_worker.engine import Engine, EngineConfig
from verifier_worker.profile import profile_sps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--model", default="dspark-target")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--drafters", default=",".join(DRAFTERS))
    p.add_argument("--json")
    args = p.parse_args()
    started = time.perf_counter()
    device = resolve_device(args.device)
    dirs = {n: resolve_model(DRAFTERS[n]) for n in args.drafters.split(",") if n}
    target = load_target(args.model, "auto", device, drafters=dirs)
    ids = eval_prompts(target.tokenizer, DATASETS, args.prompts)
    facts = machine(device)
    out: dict = {"torch": facts["torch"], "dtype": target.dtype_name, "device": facts["device"],
                 "devices": facts["devices"], **({"cuda": facts["cuda"]} if "cuda" in facts else {}),
                 "arms": {}, "identical": True}
    length = Stopping(args.tokens)
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        engine = Engine(target.model, EngineConfig(num_slots=4, max_len=1024, compile=mode == "compiled"))
        arms = out["arms"][mode] = {"engine_ready_s": round(time.perf_counter() - t0, 1)}
        generate_rate(engine, ids[:1], Stopping(8))  # warm-up
        plain = generate_rate(engine, ids, length)  # batch 1
        arms["plain_tokens_per_s"] = round(plain.tokens_per_s, 1)
        for name, directory in dirs.items():
            draft_model, calibration = load_drafter(directory, target.model, "auto", device)
            drafter = Drafter(draft_model, calibration, compile=mode == "compiled")
            gamma = 1 if name == "mtp1" else args.gamma
            generate_rate(engine, ids[:1], Stopping(8), drafter, Policy.FIXED, gamma)  # warm-up (and compile)
            spec = generate_rate(engine, ids, length, drafter, Policy.FIXED, gamma)
            same = spec.outputs == plain.outputs
            out["identical"] &= same
            arms[name] = {"identical": same, "tokens_per_s": round(spec.tokens_per_s, 1),
                          "x_plain": round(spec.tokens_per_s / plain.tokens_per_s, 2)}
        if mode == "compiled" or len(args.modes.split(",")) == 1:
            arms["sps"] = [pt.as_dict() for pt in profile_sps(engine.forward, (1, 8, 32, 128), context=256, repeats=5)]
    out["tp2"] = ({"skipped": "one device"} if out["devices"] < 2 else
                  {"skipped": "tensor parallelism is checked by tests/test_tensor_parallel.py (gloo); not run here"})
    out["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(out))
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()

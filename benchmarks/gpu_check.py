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
from pathlib import Path

import torch

from benchmarks.engine_speed import DATASETS, DRAFTERS, cpu_model, prompts
from drafter_worker.checkpoint import drafter_config, load_drafter
from drafter_worker.drafter import Drafter
from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.loader import load_model, resolve_device
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from verifier_worker.engine import Engine, EngineConfig
from verifier_worker.profile import profile_sps


def run(engine: Engine, proposer, policy: Policy, gamma: int, ids: list[list[int]], tokens: int):
    router = InProcessRouter(engine, proposer, policy, gamma)
    reqs = [GenerationRequest(f"p{i}", p, SamplingParams(max_tokens=tokens)) for i, p in enumerate(ids)]
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    results = [router.generate([r])[0] for r in reqs]  # batch 1
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    return [r.token_ids for r in results], sum(len(r.token_ids) for r in results) / elapsed


def device_facts(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"device": torch.cuda.get_device_name(device), "devices": torch.cuda.device_count(),
                "cuda": torch.version.cuda}
    return {"device": cpu_model(), "devices": 1}


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
    model_dir = resolve_model(args.model)
    ids = prompts(TextTokenizer.from_dir(model_dir), DATASETS, args.prompts)
    names = [n for n in args.drafters.split(",") if n]
    taps = tuple(sorted({t for n in names for t in drafter_config(resolve_model(DRAFTERS[n])).tap_layers}))
    model = load_model(model_dir, "auto", device, tap_layers=taps)
    out: dict = {"torch": torch.__version__, "dtype": str(model.dtype).removeprefix("torch."), **device_facts(device),
                 "arms": {}, "identical": True}
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        engine = Engine(model, EngineConfig(num_slots=4, max_len=1024, compile=mode == "compiled"))
        arms = out["arms"][mode] = {"engine_ready_s": round(time.perf_counter() - t0, 1)}
        run(engine, None, Policy.NONE, 0, ids[:1], 8)  # warm-up
        plain_tokens, plain_tps = run(engine, None, Policy.NONE, 0, ids, args.tokens)
        arms["plain_tokens_per_s"] = round(plain_tps, 1)
        for name in names:
            draft_model, calibration = load_drafter(DRAFTERS[name], model, "auto", device)
            drafter = Drafter(draft_model, calibration, compile=mode == "compiled")
            gamma = 1 if name == "mtp1" else args.gamma
            run(engine, drafter, Policy.FIXED, gamma, ids[:1], 8)  # warm-up (and the drafter's compile)
            tokens, tps = run(engine, drafter, Policy.FIXED, gamma, ids, args.tokens)
            same = tokens == plain_tokens
            out["identical"] &= same
            arms[name] = {"identical": same, "tokens_per_s": round(tps, 1), "x_plain": round(tps / plain_tps, 2)}
        if mode == "compiled" or len(args.modes.split(",")) == 1:
            arms["sps"] = [pt.as_dict() for pt in profile_sps(engine.forward, (1, 8, 32, 128), context=256, repeats=5)]
    out["tp2"] = ({"skipped": "one device"} if out["devices"] < 2 else
                  {"skipped": "tensor parallelism is checked by tests/test_tensor_parallel.py (gloo); not run here"})
    out["wall_s"] = round(time.perf_counter() - started, 1)
    text = json.dumps(out)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()

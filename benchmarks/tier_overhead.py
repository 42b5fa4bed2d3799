"""Tier overhead: what splitting drafter and verifier into gRPC services costs per cycle.

The same greedy workload (shipped target + shipped DSpark drafter, γ = 7, fixed policy; fp32 unless `--dtype`) runs
three ways in one run, at each concurrency c:
  in-process  — `InProcessRouter`: one synchronous loop over the engine and the drafter (no asyncio, no RPC);
  async-local — the tiered router and the async tier cores in this process (asyncio, no RPC);
  tiered      — verifier and drafter in their own processes, the router here, real loopback gRPC.
Per-cycle time = wall time / cycles of one request (the c requests run their cycles side by side).
Overhead = tiered − in-process per cycle, in ms and as a share of the in-process engine step (median).
Every tier uses one torch thread so the three arms do the same arithmetic on this 2-vCPU machine.

Where a tiered cycle's time goes (`breakdown`, per cycle, async-local and tiered at concurrency 1): the
drafter's and the verifier's model time (propose, engine step; timed in their compute threads), each call's
hop (the router's await of `draft`/`verify` minus the model time in it: event-loop wake-ups, the hand-off to
the compute thread and back, delta and feature packing, gRPC), and the router's own work (schedule, commit,
detokenise, metrics: the cycle minus both awaits). At concurrency > 1 the calls of the requests overlap and
the split is not additive, so it is taken at concurrency 1 only.

    python benchmarks/tier_overhead.py [--concurrency 1,8] [--max-tokens 96] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from benchmarks.harness import cpu_model
from cluster.launcher import start_tier, stop_tiers
from drafter_worker.drafter import Drafter
from drafter_worker.main import drafter_service
from drafter_worker.service import LocalDrafter
from drafter_worker.settings import DrafterSettings
from in_process.generation import GenerationRequest, InProcessRouter
from router.router import Router, RouterConfig
from router.scheduling.policy import Policy
from router.session import RouterRequest, Speculation
from router.tiers.grpc import GrpcDrafter, GrpcVerifier
from services import event_loop
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from verifier_worker.main import verifier_service
from verifier_worker.service import LocalVerifier
from verifier_worker.settings import VerifierSettings

PROMPTS = ["def fibonacci(n):", "import os\n\n", "class Stack:\n    def push(self, item):", "for i in range(10):",
           "<|user|>\nWhat is 12 + 30?<|end|>\n<|assistant|>\n", "The quick brown fox", "def main():\n",
           "import numpy as np\n"]
TIERS = {"model": "dspark-target", "dtype": "float32"}  # `--model`, `--dtype`: the same in every arm


def settings():
    model, dtype = TIERS["model"], TIERS["dtype"]
    v = VerifierSettings(model=model, dtype=dtype, port=0, threads=1, num_slots=8, max_len=512)
    d = DrafterSettings(model=model, dtype=dtype, port=0, threads=1, drafters=[f"{model}-dspark"])
    return v, d


def prompts(tok, c: int) -> list[list[int]]:
    return [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(c)]


def in_process(tok, c: int, max_tokens: int) -> tuple[float, int, float]:
    v, d = settings()
    verifier = verifier_service(v)
    drafter: Drafter = drafter_service(d).proposers["dspark"]
    engine = verifier.engine
    router = InProcessRouter(engine, drafter, Policy.FIXED, 7)
    reqs = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=max_tokens), ()) for i, p in enumerate(
        prompts(tok, c))]
    router.generate(reqs)  # warm-up
    step, timed = engine.step, []

    def timed_step():
        t = time.perf_counter()
        out = step()
        timed.append(time.perf_counter() - t)
        return out

    engine.step = timed_step
    t0 = time.perf_counter()
    results = router.generate([GenerationRequest(f"m{r.request_id}", r.prompt_ids, r.params, ()) for r in reqs])
    step_ms = 1000 * statistics.median(timed)
    return time.perf_counter() - t0, sum(r.cycles for r in results), step_ms


class Clock:
    """Sums of the time spent in wrapped callables, by name (sync or async)."""

    def __init__(self):
        self.total: dict[str, float] = {}

    def _add(self, name: str, t0: float) -> None:
        self.total[name] = self.total.get(name, 0.0) + time.perf_counter() - t0

    def sync(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(name, t0)
        return timed

    def awaited(self, name: str, fn):
        async def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                self._add(name, t0)
        return timed


def timed_tiers(verifier, drafter, clock: Clock):
    """Wrap the router's two awaits so the clock sees how long each call took as the router saw it."""
    verifier.verify = clock.awaited("verify_call", verifier.verify)
    drafter.draft = clock.awaited("draft_call", drafter.draft)
    return verifier, drafter


def breakdown(clock: Clock, wall_s: float, cycles: int) -> dict[str, float]:
    """Per-cycle milliseconds: model time and hop of each tier call, and the router's own share."""
    per = {k: 1000 * v / cycles for k, v in clock.total.items()}
    out = {"cycle": 1000 * wall_s / cycles, "draft_call": per.get("draft_call", 0.0),
           "verify_call": per.get("verify_call", 0.0)}
    if "propose" in per:
        out |= {"drafter_model": per["propose"], "drafter_hop": out["draft_call"] - per["propose"],
                "verifier_model": per["step"], "verifier_hop": out["verify_call"] - per["step"]}
    elif "drafter_step_ema" in clock.total:  # a tier in its own process: its step time as its Load reports it
        out |= {"drafter_step": clock.total["drafter_step_ema"],
                "drafter_hop": out["draft_call"] - clock.total["drafter_step_ema"],
                "verifier_step": clock.total["verifier_step_ema"],
                "verifier_hop": out["verify_call"] - clock.total["verifier_step_ema"]}
    out["router"] = out["cycle"] - out["draft_call"] - out["verify_call"]
    return {k: round(v, 3) for k, v in out.items()}


async def tiered_run(verifier, drafter, tok, c: int, max_tokens: int, tag: str) -> tuple[float, int]:
    router = Router(verifier, drafter, {"dspark"}, RouterConfig(default=Speculation("dspark", Policy.FIXED, 7)), tok)

    async def one(i, p):
        cycles = 0
        req = RouterRequest(p, SamplingParams(max_tokens=max_tokens), request_id=f"{tag}{i}")
        async for chunk in router.generate(req):
            cycles = chunk.cycle
        return cycles

    t0 = time.perf_counter()
    cycles = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts(tok, c))])
    return time.perf_counter() - t0, sum(cycles)


async def async_local(tok, c: int, max_tokens: int, clock: Clock | None = None):
    v, d = settings()
    vs, ds = verifier_service(v), drafter_service(d)
    await vs.start()
    await ds.start()
    await tiered_run(LocalVerifier(vs), LocalDrafter(ds), tok, c, max_tokens, "w")
    verifier, drafter = LocalVerifier(vs), LocalDrafter(ds)
    if clock is not None:
        vs.engine.step = clock.sync("step", vs.engine.step)
        proposer = ds.proposers["dspark"]
        proposer.propose = clock.sync("propose", proposer.propose)
        verifier, drafter = timed_tiers(verifier, drafter, clock)
    out = await tiered_run(verifier, drafter, tok, c, max_tokens, "m")
    await vs.stop()
    await ds.stop()
    return out


async def over_grpc(addresses, tok, c: int, max_tokens: int, clock: Clock | None = None):
    verifier, drafter = GrpcVerifier(addresses[0]), GrpcDrafter(addresses[1])
    await tiered_run(verifier, drafter, tok, c, max_tokens, "w")
    if clock is not None:
        verifier, drafter = timed_tiers(verifier, drafter, clock)
    out = await tiered_run(verifier, drafter, tok, c, max_tokens, "m")
    if clock is not None:  # EMAs of the last ~10 steps of each tier (in its compute thread, hand-off included)
        clock.total["verifier_step_ema"] = (await verifier.load()).step_ms_ema
        clock.total["drafter_step_ema"] = (await drafter.load()).step_ms_ema
    await verifier.close()
    await drafter.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3, help="medians over this many runs of each arm")
    parser.add_argument("--model", default=TIERS["model"], help="target (its -dspark drafter drafts)")
    parser.add_argument("--dtype", default=TIERS["dtype"], help="of both tiers in every arm (auto: bf16 where native)")
    parser.add_argument("--json", default="benchmarks/results/tier-overhead-cpu.json")
    args = parser.parse_args()
    TIERS.update(model=args.model, dtype=args.dtype)
    torch.set_num_threads(1)
    tok = TextTokenizer.from_dir(resolve_model(args.model))
    v, d = settings()
    tiers = [start_tier("verifier", v), start_tier("drafter", d)]
    rows = []
    try:
        for c in (int(x) for x in args.concurrency.split(",")):
            per, steps = {"in_process": [], "async_local": [], "tiered": []}, []
            for _ in range(args.rounds):  # arms interleaved, so a slow spell of this VM hits them alike
                wall, cycles, step_ms = in_process(tok, c, args.max_tokens)
                per["in_process"].append(1000 * wall / (cycles / c))
                steps.append(step_ms)
                wall, cycles = event_loop.run(async_local(tok, c, args.max_tokens))
                per["async_local"].append(1000 * wall / (cycles / c))
                wall, cycles = event_loop.run(over_grpc([t.address for t in tiers], tok, c, args.max_tokens))
                per["tiered"].append(1000 * wall / (cycles / c))
            med = {k: statistics.median(v) for k, v in per.items()}
            step_ms = statistics.median(steps)
            overhead = med["tiered"] - med["in_process"]
            split = {}
            if c == 1:  # one more run of each, instrumented; with c > 1 the requests' calls overlap: not additive
                clocks = {"async_local": Clock(), "tiered": Clock()}
                wall, cycles = event_loop.run(async_local(tok, c, args.max_tokens, clocks["async_local"]))
                split["async_local"] = breakdown(clocks["async_local"], wall, cycles)
                wall, cycles = event_loop.run(over_grpc([t.address for t in tiers], tok, c, args.max_tokens,
                                                        clocks["tiered"]))
                split["tiered"] = breakdown(clocks["tiered"], wall, cycles)
            rows.append({"concurrency": c, **{f"{k}_ms_per_cycle": round(x, 2) for k, x in med.items()},
                         "verify_step_ms": round(step_ms, 2), "overhead_ms": round(overhead, 2),
                         "overhead_pct_of_verify_step": round(100 * overhead / step_ms, 1),
                         "overhead_pct_of_cycle": round(100 * overhead / med["in_process"], 1),
                         "breakdown_ms_per_cycle": split,
                         "rounds": {k: [round(x, 2) for x in v] for k, v in per.items()}})
    finally:
        stop_tiers(tiers)
    print(f"{'c':>3} {'in-process':>11} {'async-local':>12} {'tiered':>8} {'verify step':>12} {'overhead':>9} "
          f"{'%step':>6}  (ms per cycle)")
    for r in rows:
        print(f"{r['concurrency']:>3} {r['in_process_ms_per_cycle']:>11.2f} {r['async_local_ms_per_cycle']:>12.2f} "
              f"{r['tiered_ms_per_cycle']:>8.2f} {r['verify_step_ms']:>12.2f} {r['overhead_ms']:>9.2f} "
              f"{r['overhead_pct_of_verify_step']:>6.1f}")
    print("\nper cycle, ms (one instrumented run each; hop = the router's await minus the model time in it)")
    for r in rows:
        for arm, split in r["breakdown_ms_per_cycle"].items():
            print(f"  c={r['concurrency']} {arm:<12} " + "  ".join(f"{k} {v:.2f}" for k, v in split.items()))
    meta = {"machine": cpu_model(), "cpus": torch.get_num_threads(),
            "torch": torch.__version__, "max_tokens": args.max_tokens, "gamma": 7, "model": args.model,
            "dtype": args.dtype}
    with open(args.json, "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()

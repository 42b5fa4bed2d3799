"""The drafter running ahead across the tiers: per-user tokens/s with the speculation cache on and off.

Verifier and drafter in their own processes (one torch thread each, real loopback gRPC), the router here. For
each method and concurrency c, rounds alternate between the same requests sent without and with `ahead`
(the drafter replica has a speculation cache of `--budget` blocks per request; `ahead` only makes the router
send the notices), so the ratio compares like with like in one run. Also reported: the cache's hit rate and
the drafts accepted per cycle of cached blocks against all cycles (from the router's metrics).

    python benchmarks/ahead.py [--methods dspark,dflash,eagle3] [--concurrency 1,2,4] [--temperature 0]
                               [--max-tokens 64] [--rounds 3] [--budget 24] [--rtt-ms 0,1,5,20] [--json PATH]
                               [--target dspark-target|gemma-3-270m] [--dtype float32|bfloat16|auto]

`--rtt-ms`: the router reaches the drafter through a user-space network path (`benchmarks/net_proxy.py`; this
kernel has no netem) adding that round trip, one path per value (0: the proxy's own hop only, so every row pays
the same relay and differs only by the delay); the verifier is reached directly.

`--target gemma-3-270m` runs the real model (its GGUF from pip, under the Gemma terms: ai.google.dev/gemma/terms)
with its shipped drafters; `--dtype auto` serves bf16 where the CPU has it natively, fp32 elsewhere.

`--in-process`: the cache's quality alone, without timing: 12 eval prompts (4 per domain), the in-process
router drafting and drafting ahead in turn, against the same drafter without the cache (τ, hit rate, drafts
accepted per cycle of cached blocks and of the freshly drafted ones). `--steer TOP,FACTOR` adds Saguaro
sampling (`drafter_worker/speculation.py: Steering`): across the tiers on the drafter replica, in process as a
third arm beside fresh and ahead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from benchmarks.harness import cpu_model
from benchmarks.net_proxy import NetProxy
from benchmarks.tier_overhead import PROMPTS
from cluster.launcher import start_tier, stop_tiers
from drafter_worker.settings import DrafterSettings
from router.router import Router, RouterConfig
from router.scheduling.policy import Policy
from router.session import RouterRequest, Speculation
from router.tiers.grpc import GrpcDrafter, GrpcVerifier
from services.loader import resolve_dtype
from services.registry import model_name, resolve_model
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from verifier_worker.settings import VerifierSettings

TARGET = "dspark-target"


async def one_round(addresses, tok, method: str, c: int, ahead: bool, args, tag: str) -> dict:
    verifier, drafter = GrpcVerifier(addresses[0]), GrpcDrafter(addresses[1])
    router = Router(verifier, drafter, {method}, RouterConfig(default=Speculation(method, Policy.FIXED, args.gamma)),
                    tok)

    async def run(i: int, prompt: str) -> float:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=i)
        request = RouterRequest(tok.encode(prompt), params, request_id=f"{tag}-{i}", speculative={"ahead": ahead})
        started, n = time.perf_counter(), 0
        async for chunk in router.generate(request):
            n += len(chunk.token_ids)
        return n / (time.perf_counter() - started)

    speeds = await asyncio.gather(*[run(i, PROMPTS[i % len(PROMPTS)]) for i in range(c)])
    m = router.metrics
    value = lambda counter: counter.labels("")._value.get()  # noqa: E731
    hits, misses, pushed = value(m.spec_cache_hits), value(m.spec_cache_misses), value(m.spec_cache_pushed)
    cycles, accepted = m.totals()
    ahead_accepted = sum(s.value for s in m.ahead_accepted_per_pos.collect()[0].samples if s.name.endswith("_total"))
    await verifier.close()
    await drafter.close()
    return {"tok_s": statistics.mean(speeds), "hits": hits, "misses": misses, "pushed": pushed, "cycles": cycles,
            "accepted": accepted, "ahead_accepted": ahead_accepted}


def in_process(method: str, temperature: float, budget: int, gamma: int, max_tokens: int,
               steering=None, target_name: str = TARGET) -> dict:
    import torch

    from drafter_worker.ahead import RunAhead
    from drafter_worker.checkpoint import drafter_config, load_drafter
    from drafter_worker.drafter import Drafter
    from in_process.generation import GenerationRequest, InProcessRouter
    from services.loader import load_model
    from verifier_worker.engine import Engine, EngineConfig

    torch.set_num_threads(1)
    tdir, ddir = resolve_model(target_name), resolve_model(f"{model_name(target_name)}-{method}")
    tok = TextTokenizer.from_dir(tdir)
    target = load_model(tdir, "float32", "cpu", tap_layers=drafter_config(ddir).tap_layers)
    model, calibration = load_drafter(ddir, target, "float32")
    datasets = Path(__file__).parent / "datasets"
    prompts = [tok.encode(json.loads(line)["prompt"])[-200:] for d in ("code", "chat", "math")
               for line in (datasets / f"{d}.jsonl").read_text().splitlines()[:4]]
    requests = [GenerationRequest(f"r{i}", ids, SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i))
                for i, ids in enumerate(prompts)]
    row = {"method": method, "temperature": temperature, "budget": budget}
    arms = [("fresh", Drafter(model, calibration)), ("ahead", RunAhead(Drafter(model, calibration), budget))]
    if steering is not None:
        arms.append(("steered", RunAhead(Drafter(model, calibration), budget, steering)))
    for name, proposer in arms:
        engine = Engine(target, EngineConfig(num_slots=4, max_len=400))
        results = InProcessRouter(engine, proposer, Policy.FIXED, 1 if method == "mtp" else gamma).generate(requests)
        cycles, accepted = sum(r.cycles for r in results), sum(r.accepted_tokens for r in results)
        row[f"tau_{name}"] = round(sum(r.cycle_tokens for r in results) / cycles, 3)
        if name != "fresh":
            stats, hit_cycles = proposer.cache.stats, sum(r.ahead_cycles for r in results)
            hit_accepted = sum(r.ahead_accepted for r in results)
            tag = "" if name == "ahead" else f"_{name}"
            row |= {f"hit_rate{tag}": round(stats.hits / max(1, stats.hits + stats.misses), 3),
                    f"accepted_per_cached_cycle{tag}": round(hit_accepted / max(1, hit_cycles), 3),
                    f"accepted_per_missed_cycle{tag}": round((accepted - hit_accepted) / max(1, cycles - hit_cycles),
                                                             3)}
        else:
            row["accepted_per_cycle_fresh"] = round(accepted / cycles, 3)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="dspark,dflash,eagle3")
    p.add_argument("--concurrency", default="1,2,4")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget", type=int, default=24)
    p.add_argument("--json")
    p.add_argument("--target", default=TARGET, help="the target model (its drafters are <target>-<method>)")
    p.add_argument("--dtype", default="float32", help="served dtype of both tiers (auto: bf16 where native)")
    p.add_argument("--in-process", action="store_true", help="hit rate and acceptance only (no tiers, no timing)")
    p.add_argument("--pin", action="store_true", help="verifier on CPU 0, drafter on CPU 1 (the router floats)")
    p.add_argument("--steer", help="TOP,FACTOR: Saguaro sampling of the drafts of requests that draft ahead")
    p.add_argument("--rtt-ms", help="added round trips between router and drafter, e.g. 0,1,5,20 (default: none)")
    args = p.parse_args()
    methods = args.methods.split(",")
    top, factor = args.steer.split(",") if args.steer else (0, 0.5)
    top, factor = int(top), float(factor)
    if args.in_process:
        from drafter_worker.speculation import Steering

        steering = Steering(top, factor) if top else None
        rows = [in_process(m, args.temperature, args.budget, args.gamma, args.max_tokens, steering, args.target)
                for m in methods]
        for row in rows:
            print(json.dumps(row), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"cpu": cpu_model(), "rows": rows}, indent=1))
        return
    drafters = [f"{model_name(args.target)}-{m}" for m in methods]
    pins = ([0], [1]) if args.pin else (None, None)
    dtype = str(resolve_dtype(args.dtype)).removeprefix("torch.")  # the settings take the name
    verifier = start_tier("verifier", VerifierSettings(model=args.target, dtype=dtype, port=0, threads=1, num_slots=8,
                                                       max_len=512, cpus=pins[0]))
    drafter = start_tier("drafter", DrafterSettings(model=args.target, dtype=dtype, port=0, threads=1,
                                                    drafters=drafters, cpus=pins[1], ahead_budget=args.budget,
                                                    steer_top=top, steer_factor=factor))
    tok = TextTokenizer.from_dir(resolve_model(args.target))
    rows = []
    paths = [None] if args.rtt_ms is None else [float(x) for x in args.rtt_ms.split(",")]
    try:
        for rtt in paths:
            proxy = None if rtt is None else NetProxy(drafter.address, one_way_s=rtt / 2000)
            addresses = (verifier.address, drafter.address if proxy is None else proxy.address)
            try:
                for method in methods:
                    for c in (int(x) for x in args.concurrency.split(",")):
                        runs = {False: [], True: []}
                        for r in range(args.rounds + 1):  # round 0 warms both arms up and is not counted
                            for ahead in (False, True) if r % 2 == 0 else (True, False):
                                tag = f"{method}{c}{r}{ahead}{rtt}"
                                out = asyncio.run(one_round(addresses, tok, method, c, ahead, args, tag))
                                if r > 0:
                                    runs[ahead].append(out)
                        row = _row(method, c, runs) | ({} if rtt is None else {"rtt_ms": rtt})
                        rows.append(row)
                        print(json.dumps(row), flush=True)
            finally:
                if proxy is not None:
                    proxy.close()
    finally:
        stop_tiers([verifier, drafter])
    report = {"cpu": cpu_model(), "target": args.target, "dtype": dtype, "pinned": args.pin,
              "temperature": args.temperature, "gamma": args.gamma,
              "budget": args.budget, "max_tokens": args.max_tokens, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def _row(method: str, c: int, runs: dict[bool, list[dict]]) -> dict:
    off = statistics.median(r["tok_s"] for r in runs[False])
    on = statistics.median(r["tok_s"] for r in runs[True])
    total = lambda key: sum(r[key] for r in runs[True])  # noqa: E731
    lookups = total("hits") + total("misses")
    return {"method": method, "c": c, "tok_s_off": round(off, 1), "tok_s_ahead": round(on, 1),
            "ratio": round(on / off, 3), "hit_rate": round(total("hits") / lookups, 3) if lookups else None,
            "pushed_rate": round(total("pushed") / lookups, 3) if lookups else None,
            "accepted_per_cycle": round(total("accepted") / max(1, total("cycles")), 3),
            "accepted_per_cached_cycle": round(total("ahead_accepted") / max(1, total("hits")), 3)}


if __name__ == "__main__":
    main()

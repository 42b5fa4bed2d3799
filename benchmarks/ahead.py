"""The drafter running ahead across the tiers: per-user tokens/s with the speculation cache on and off.

Verifier and drafter in their own processes (one torch thread each, real loopback gRPC), the router here. For
each method and concurrency c, rounds alternate between the same requests sent without and with `ahead`
(the drafter replica has a speculation cache of `--budget` blocks per request; `ahead` only makes the router
send the notices), so the ratio compares like with like in one run. Also reported: the cache's hit rate and
the drafts accepted per cycle of cached blocks against all cycles (from the router's metrics).

    python benchmarks/ahead.py [--methods dspark,dflash,eagle3] [--concurrency 1,2,4] [--temperature 0]
                               [--max-tokens 64] [--rounds 3] [--budget 24] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from benchmarks.engine_speed import cpu_model
from benchmarks.tier_overhead import PROMPTS
from cluster.launcher import start_tier
from drafter_worker.settings import DrafterSettings
from router.router import Router, RouterConfig
from router.scheduling.policy import Policy
from router.session import RouterRequest, Speculation
from router.tiers.grpc import GrpcDrafter, GrpcVerifier
from services.registry import resolve_model
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
    hits, misses = value(m.spec_cache_hits), value(m.spec_cache_misses)
    cycles, accepted = m.totals()
    ahead_accepted = sum(s.value for s in m.ahead_accepted_per_pos.collect()[0].samples if s.name.endswith("_total"))
    await verifier.close()
    await drafter.close()
    return {"tok_s": statistics.mean(speeds), "hits": hits, "misses": misses, "cycles": cycles,
            "accepted": accepted, "ahead_accepted": ahead_accepted}


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
    args = p.parse_args()
    methods = args.methods.split(",")
    drafters = [f"{TARGET}-{m}" for m in methods]
    verifier = start_tier("verifier", VerifierSettings(dtype="float32", port=0, threads=1, num_slots=8, max_len=512))
    drafter = start_tier("drafter", DrafterSettings(dtype="float32", port=0, threads=1, drafters=drafters,
                                                    ahead_budget=args.budget))
    tok = TextTokenizer.from_dir(resolve_model(TARGET))
    rows = []
    try:
        addresses = (verifier.address, drafter.address)
        for method in methods:
            for c in (int(x) for x in args.concurrency.split(",")):
                runs = {False: [], True: []}
                for r in range(args.rounds + 1):  # round 0 warms both arms up and is not counted
                    for ahead in (False, True) if r % 2 == 0 else (True, False):
                        out = asyncio.run(one_round(addresses, tok, method, c, ahead, args, f"{method}{c}{r}{ahead}"))
                        if r > 0:
                            runs[ahead].append(out)
                row = _row(method, c, runs)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        verifier.stop()
        drafter.stop()
    report = {"cpu": cpu_model(), "temperature": args.temperature, "gamma": args.gamma, "budget": args.budget,
              "max_tokens": args.max_tokens, "rows": rows}
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
            "accepted_per_cycle": round(total("accepted") / max(1, total("cycles")), 3),
            "accepted_per_cached_cycle": round(total("ahead_accepted") / max(1, total("hits")), 3)}


if __name__ == "__main__":
    main()

"""Verify-length policies under load: per-user and total tok/s of none, mtp1, fixed (γ = 7) and dspark.

One tiered stack serves every arm (the policy is a per-request option): verifier and drafter in their
own processes (one torch thread each, fp32, the shipped target with its DSpark and MTP drafters), the
router in this process reading a private Redis load board. Closed loop: at concurrency c, c clients
send requests back to back, each `--requests` of them, prompts round robin from the shipped code /
math / chat eval sets, exactly `--max-tokens` output tokens (EOS ignored). Arms are interleaved at each
c. Per-user tok/s is the mean over requests of output tokens / latency; total tok/s is all output
tokens / the arm's wall time. Matched throughput: each mtp1 point's total tok/s is located on dspark's
curve (linear between its concurrency points) and the two per-user speeds compared there.

    python benchmarks/policies.py [--concurrency 1,2,4,8,16] [--max-tokens 64] [--requests 2]
                                  [--temperature 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import platform
import shutil
import statistics
import time
from pathlib import Path

from cluster.launcher import RedisProcess, start_tiers, stop_tiers
from drafter_worker.settings import DrafterSettings
from router.router import Router, RouterConfig
from router.scheduling.board_view import BoardView
from router.scheduling.planner import VerifyPlanner
from router.session import RouterRequest
from router.tiers.grpc import GrpcDrafter, GrpcVerifier
from services.load_board import RedisBoard
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from verifier_worker.settings import VerifierSettings

DATASETS = Path(__file__).parent / "datasets"
ARMS = {"none": {"method": "none"}, "mtp1": {"method": "mtp", "policy": "mtp1"},
        "fixed": {"method": "dspark", "policy": "fixed", "gamma": 7},
        "dspark": {"method": "dspark", "policy": "dspark", "gamma": 7}}


def load_prompts(tok: TextTokenizer, per_domain: int = 8) -> list[list[int]]:
    sets = [[json.loads(line)["prompt"] for line in (DATASETS / f"{d}.jsonl").read_text().splitlines()][:per_domain]
            for d in ("code", "math", "chat")]
    return [tok.encode(p) for trio in zip(*sets, strict=True) for p in trio]  # code, math, chat, code, …


def counters(router: Router) -> dict[str, float]:
    m = router.metrics
    return {"drafts": m.num_drafts.labels("")._value.get(), "draft_tokens": m.num_draft_tokens.labels("")._value.get(),
            "accepted": m.num_accepted_tokens.labels("")._value.get(),
            "trimmed": m.trimmed_draft_tokens.labels("")._value.get(),
            "budget_sum": m.verify_budget.labels("")._sum.get(),
            "budget_n": sum(b.get() for b in m.verify_budget.labels("")._buckets)}


async def run_arm(router: Router, prompts, arm: str, c: int, requests: int, max_tokens: int,
                  temperature: float) -> dict:
    before, latencies, cursor = counters(router), [], [0]

    async def client(i: int) -> None:
        for n in range(requests):
            ids = prompts[(cursor[0] + i * requests + n) % len(prompts)]
            req = RouterRequest(ids, SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=n),
                                request_id=f"{arm}-{c}-{i}-{n}", speculative=ARMS[arm])
            t0, tokens = time.perf_counter(), 0
            async for chunk in router.generate(req):
                tokens += len(chunk.token_ids)
            latencies.append((tokens, time.perf_counter() - t0))

    t0 = time.perf_counter()
    await asyncio.gather(*[client(i) for i in range(c)])
    wall = time.perf_counter() - t0
    d = {k: v - before[k] for k, v in counters(router).items()}
    return {"arm": arm, "concurrency": c, "requests": len(latencies),
            "per_user_tok_s": statistics.mean(t / s for t, s in latencies),
            "total_tok_s": sum(t for t, _ in latencies) / wall,
            "tau": 1 + d["accepted"] / d["drafts"] if d["drafts"] else 1.0,
            "mean_verify_len": d["draft_tokens"] / max(1, d["drafts"]),
            "trimmed_share": d["trimmed"] / (d["trimmed"] + d["draft_tokens"]) if d["draft_tokens"] else 0.0,
            "mean_budget": d["budget_sum"] / d["budget_n"] if d["budget_n"] else None}


def per_user_at(points: list[dict], total: float) -> float | None:
    """Per-user tok/s on an arm's curve at this total tok/s (linear between points), None outside it."""
    pts = sorted((p["total_tok_s"], p["per_user_tok_s"]) for p in points)
    for (t0, u0), (t1, u1) in itertools.pairwise(pts):
        if t0 <= total <= t1:
            return u0 + (u1 - u0) * (total - t0) / (t1 - t0) if t1 > t0 else max(u0, u1)
    return None


async def bench(args, verifier_address: str, drafter_address: str, redis_url: str | None) -> list[dict]:
    tok = TextTokenizer.from_dir(resolve_model("dspark-target"))
    prompts = load_prompts(tok)
    verifier, drafter = GrpcVerifier(verifier_address), GrpcDrafter(drafter_address)
    board = BoardView(RedisBoard(redis_url)) if redis_url else None
    router = Router(verifier, drafter, {"dspark", "mtp"}, RouterConfig(max_running=64), tok,
                    planner=VerifyPlanner(0.3, board))
    await router.start()
    while router.planner.sps is None:
        await asyncio.sleep(0.1)
    for arm in ARMS:  # warm-up: every code path once, and the dspark estimates some outcomes to learn from
        await run_arm(router, prompts, arm, 4 if arm == "dspark" else 1, 1, args.max_tokens, args.temperature)
    rows = []
    for c in args.concurrency:
        for arm in ARMS:
            row = await run_arm(router, prompts, arm, c, args.requests, args.max_tokens, args.temperature)
            print(f"c={c:<3} {arm:<7} per-user {row['per_user_tok_s']:6.1f} tok/s  total {row['total_tok_s']:6.1f}"
                  f" tok/s  τ {row['tau']:.2f}  ℓ̄ {row['mean_verify_len']:.2f}", flush=True)
            rows.append(row)
    await router.stop()
    await verifier.close()
    await drafter.close()
    return rows


def report(rows: list[dict]) -> dict:
    by = {arm: [r for r in rows if r["arm"] == arm] for arm in ARMS}
    print("\n| c | arm | per-user tok/s | total tok/s | τ | mean ℓ | trimmed | mean K |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        k = "" if r["mean_budget"] is None else f"{r['mean_budget']:.1f}"
        print(f"| {r['concurrency']} | {r['arm']} | {r['per_user_tok_s']:.1f} | {r['total_tok_s']:.1f} | "
              f"{r['tau']:.2f} | {r['mean_verify_len']:.2f} | {100 * r['trimmed_share']:.0f} % | {k} |")
    below = [(d["concurrency"], round(d["per_user_tok_s"] / n["per_user_tok_s"], 3),
              round(d["total_tok_s"] / n["total_tok_s"], 3)) for d, n in zip(by["dspark"], by["none"], strict=True)]
    print("\ndspark / none at each c (per-user, total):", below)
    matched = []
    for m in by["mtp1"]:
        u = per_user_at(by["dspark"], m["total_tok_s"])
        matched.append({"total_tok_s": round(m["total_tok_s"], 1), "mtp1": round(m["per_user_tok_s"], 2),
                        "dspark": None if u is None else round(u, 2),
                        "ratio": None if u is None else round(u / m["per_user_tok_s"], 3)})
    print("dspark / mtp1 per-user at matched total throughput:", matched)
    return {"dspark_vs_none": below, "dspark_vs_mtp1_matched": matched}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2, help="requests per client at each point")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/policies-cpu.json"))
    args = ap.parse_args()
    redis = RedisProcess().start() if shutil.which("redis-server") else None
    url = redis.url if redis else None
    v = VerifierSettings(dtype="float32", port=0, threads=1, num_slots=max(args.concurrency), max_len=1024,
                         profile=True, redis_url=url)
    d = DrafterSettings(dtype="float32", port=0, threads=1, drafters=["dspark-target-dspark", "dspark-target-mtp"],
                        redis_url=url)
    tiers = start_tiers([("verifier", v), ("drafter", d)])
    try:
        rows = asyncio.run(bench(args, tiers[0].address, tiers[1].address, url))
    finally:
        stop_tiers(tiers)
        if redis is not None:
            redis.stop()
    summary = report(rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "args": {
        k: v for k, v in vars(args).items() if k != "json"}, "rows": rows, **summary}, indent=1))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

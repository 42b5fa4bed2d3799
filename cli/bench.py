"""`dspark bench`: the serving benchmark against a running API (`--base-url`) or a stack it starts itself."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from pathlib import Path

ARM_NAMES = "none,mtp1,eagle3,dflash,dspark-fixed,dspark,dspark-ahead"


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="serving benchmark: latency, throughput and speculation figures per arm and load")
    p.add_argument("--base-url", help="a running dspark API (default: start `dspark serve` for the run)")
    p.add_argument("--config", type=Path, help="`dspark serve --config` file of the stack it starts")
    p.add_argument("--api-key", default=os.environ.get("DSPARK_API_KEY"))
    p.add_argument("--model", help="target the stack it starts serves, and the requests' model (default: "
                   "dspark-target)")
    p.add_argument("--arms", default=ARM_NAMES, help="comma-separated, from " + ARM_NAMES)
    p.add_argument("--concurrency", default="1,2,4,8", help="closed-loop concurrencies (empty: none)")
    p.add_argument("--rates", default="", help="open-loop Poisson request rates per second (empty: none)")
    p.add_argument("--requests", type=int, default=16, help="requests per arm and load")
    p.add_argument("--dataset", default="mix", choices=("code", "math", "chat", "mix", "json", "random"))
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--gamma", type=int, default=7, help="γ of the fixed and scheduled arms")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--slo-e2el-ms", type=float)
    p.add_argument("--dist-samples", type=int, default=0, help="T = 1 requests per arm for the sampled "
                   "distribution gate (0: off)")
    p.add_argument("--out-dir", type=Path, default=Path("build/bench"))


def run_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from benchmarks.serve_bench.local_server import serve_locally
    from benchmarks.serve_bench.metrics import Slo
    from benchmarks.serve_bench.plots import plots
    from benchmarks.serve_bench.report import markdown
    from benchmarks.serve_bench.runner import BenchConfig, loads, run
    from benchmarks.serve_bench.workloads import load_workload

    slo = None
    if any(v is not None for v in (args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms)):
        slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms)
    cfg = BenchConfig(args.base_url or "", load_workload(args.dataset, input_len=args.random_input_len,
                                                         seed=args.seed),
                      [a for a in args.arms.split(",") if a], _numbers(args.concurrency, int),
                      _numbers(args.rates, float), args.requests, args.max_tokens, args.temperature, args.gamma,
                      args.seed, slo, args.model or "dspark-target", args.api_key, args.dist_samples)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if not args.base_url:
            cfg.base_url = stack.enter_context(serve_locally(args.config, args.out_dir / "server.log",
                                                                 args.model))
        total = len(cfg.arms) * (len(loads(cfg)) * cfg.requests + cfg.dist_samples)
        with Progress() as progress:
            task = progress.add_task("dspark bench", total=total)
            results = asyncio.run(run(cfg, lambda: progress.advance(task)))
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=1))
    images = plots(results, args.out_dir)
    (args.out_dir / "summary.md").write_text(markdown(results, images, base=args.out_dir))
    console = Console()
    console.print(f"results in {args.out_dir}/: results.json, summary.md, {', '.join(p.name for p in images)}")
    gates = results["gates"]
    failed = [a for a, ok in gates.get("greedy_identical", {}).items() if not ok]
    failed += [a for a, g in gates.get("distribution", {}).items() if not g["passed"]]
    if failed:
        console.print(f"[red]losslessness gate FAILED[/red] for: {', '.join(sorted(set(failed)))}")
        return 1
    return 0


def _numbers(text: str, kind):
    return [kind(x) for x in text.split(",") if x.strip()]

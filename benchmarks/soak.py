"""Soak: bounded mixed load against `dspark serve` for a while, watching for leaks, errors and drift.

Closed-loop clients send the mix of `benchmarks/serve_bench/mixed.py` (completions and chat, streamed or not,
greedy and T = 1, short and long, every speculative arm, hang-ups mid-stream, bad requests) for `--duration`
seconds. Every `--sample-every` seconds it records the RSS of each process of the deployment (the serve process
and its descendants: Ray's processes and the workers hosting the replica actors), the router's running and
waiting gauges, and the replicas' loads. Once the load stops, everything in flight must drain to zero within
`--drain-s`: router running / waiting, verifier KV slots / queued prefills / streams, drafter contexts / streams.
Exit code 1 when a request went wrong, something leaked, or a process of the deployment exited.

    python benchmarks/soak.py [--base-url URL | --config serve.yaml] [--duration 600] [--clients 4]
                              [--sample-every 5] [--out benchmarks/results/soak-cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

from benchmarks.serve_bench import deployment
from benchmarks.serve_bench.mixed import Mix, RequestRecord, draw, request, send
from benchmarks.serve_bench.runner import host_metadata
from benchmarks.serve_bench.soak_report import analyse, print_report
from benchmarks.serve_bench.workloads import load_workload


@dataclass(slots=True)
class SoakConfig:
    base_url: str
    duration_s: float = 600.0
    clients: int = 4
    sample_every_s: float = 5.0
    window_fraction: float = 0.2  # the first and last latency windows, as shares of the run
    drain_s: float = 30.0  # how long in-flight work may take to clear once the load stops
    seed: int = 0
    namespace: str = "dspark"  # Ray namespace of the deployment's controller
    api_key: str | None = None
    mix: Mix = field(default_factory=Mix)


@dataclass(slots=True)
class Sampler:
    """The deployment's processes, router gauges and tier loads, sampled on a timer."""

    root: psutil.Process
    tiers: deployment.TierLoads
    http: httpx.AsyncClient
    t0: float
    labels: dict[int, str] = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)
    _procs: dict[int, psutil.Process] = field(default_factory=dict)

    async def sample(self) -> dict:
        for proc in deployment.processes(self.root):  # new workers appear, e.g. a restarted replica
            self._procs.setdefault(proc.pid, proc)
            # A Ray worker is ray::IDLE until it hosts an actor; a process gone meanwhile keeps its last label.
            self.labels[proc.pid] = deployment.label(proc) or self.labels.get(proc.pid, "?")
        sample = {"t": time.perf_counter() - self.t0, "rss_mb": deployment.rss_mb(list(self._procs.values())),
                  "router": await deployment.router_gauges(self.http),
                  "tiers": deployment.busy(await self.tiers.read())}
        self.samples.append(sample)
        return sample

    async def run(self, every_s: float) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(every_s)


async def client(http: httpx.AsyncClient, cfg: SoakConfig, index: int, prompts: list, deadline: float, t0: float,
                 outcomes: list[RequestRecord]) -> None:
    """One closed-loop client: the next request as soon as the last one ends, until the deadline."""
    rng = random.Random(cfg.seed * 1000 + index)
    n = 0
    while time.perf_counter() < deadline:
        shape = draw(rng, cfg.mix)
        path, body = request(shape, cfg.mix, rng.choice(prompts), seed=cfg.seed + 1000 * n + index)
        outcomes.append(await send(http, shape, path, body, t0))
        n += 1
        if outcomes[-1].error == "transport":
            await asyncio.sleep(1.0)  # a server that is down refuses at once: do not spin on it


async def drain(sampler: Sampler, drain_s: float, every_s: float = 0.5) -> dict:
    """Sample until nothing is in flight any more, or `drain_s` has passed → the last sample's non-zero counts."""
    deadline = time.perf_counter() + drain_s
    while True:
        last = await sampler.sample()
        left = {k: v for k, v in {**last["router"], **last["tiers"]}.items() if v}
        if not left or time.perf_counter() > deadline:
            return left
        await asyncio.sleep(every_s)


async def soak(cfg: SoakConfig) -> dict:
    root = deployment.server_process(cfg.base_url)
    ray_address = deployment.gcs_address(deployment.processes(root)) or "auto"
    replicas = deployment.replica_addresses(ray_address, cfg.namespace)  # before any load: blocking is fine
    tiers = deployment.TierLoads(replicas)
    prompts = load_workload("mix").prompts
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    try:
        async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=300, limits=limits) as http:
            t0 = time.perf_counter()
            sampler, outcomes = Sampler(root, tiers, http, t0), []
            sampling = asyncio.create_task(sampler.run(cfg.sample_every_s))
            await asyncio.gather(*(client(http, cfg, i, prompts, t0 + cfg.duration_s, t0, outcomes)
                                   for i in range(cfg.clients)))
            load_s = time.perf_counter() - t0
            sampling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampling
            leaks = await drain(sampler, cfg.drain_s)
    finally:
        await tiers.close()
    return analyse(cfg, load_s, outcomes, sampler.samples, sampler.labels, leaks) | {
        "replicas": replicas, "metadata": run_metadata(cfg)}


def run_metadata(cfg: SoakConfig) -> dict:
    return {**host_metadata(), **{k: v for k, v in asdict(cfg).items() if k != "api_key"}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="a running dspark API on this host (default: start `dspark serve`)")
    p.add_argument("--config", type=Path, help="`dspark serve --config` file of the server it starts")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--short-tokens", type=int, default=Mix().short_tokens, help="max_tokens of short requests")
    p.add_argument("--long-tokens", type=int, default=Mix().long_tokens, help="max_tokens of long requests")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--drain-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--namespace", default="dspark", help="Ray namespace of the deployment")
    p.add_argument("--api-key")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/soak-cpu.json"))
    p.add_argument("--server-log", type=Path, default=Path("build/soak-server.log"), help="log of the server it starts")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = SoakConfig(args.base_url or "", args.duration, args.clients, args.sample_every, drain_s=args.drain_s,
                     seed=args.seed, namespace=args.namespace, api_key=args.api_key,
                     mix=Mix(short_tokens=args.short_tokens, long_tokens=args.long_tokens))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if not args.base_url:
            cfg.base_url = stack.enter_context(deployment.started(args.config, args.server_log))
        results = asyncio.run(soak(cfg))
    args.out.write_text(json.dumps(results, indent=1))
    print_report(results)
    print(f"results in {args.out}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

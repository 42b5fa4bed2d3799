"""`dspark bench`'s run: every arm at every load against one server, counters diffed per cell, gates.

Loads are closed loop (C clients back to back) and open loop (Poisson arrivals at λ requests/s). At
each load the arms run one after another on the same server (the arm is a per-request option), each
cell between two scrapes of /metrics, so server-side figures (τ, acceptance, verify budget, wasted
tokens) belong to that cell alone. Gates: greedy arms must produce the `none` arm's text request for
request; sampled arms must match `none`'s distribution of the first three tokens (permutation χ² test).
"""

from __future__ import annotations

import asyncio
import platform
import random
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np

from benchmarks.serve_bench.client import complete, speculative
from benchmarks.serve_bench.metrics import RequestResult, Slo, summarize
from benchmarks.serve_bench.server_metrics import scrape, spec_decode
from benchmarks.serve_bench.workloads import Workload

GATE_P = 1e-3  # a sampled arm fails its distribution gate below this p-value


@dataclass(slots=True)
class BenchConfig:
    base_url: str
    workload: Workload
    arms: list[str] = field(default_factory=lambda: ["none", "mtp1", "dspark-fixed", "dspark"])
    concurrency: list[int] = field(default_factory=lambda: [1, 4])
    rates: list[float] = field(default_factory=list)  # open-loop request rates (requests/s)
    requests: int = 16  # per cell
    max_tokens: int = 64
    temperature: float = 0.0
    gamma: int = 7
    seed: int = 0
    slo: Slo | None = None
    model: str = "dspark-target"
    api_key: str | None = None
    dist_samples: int = 0  # per arm, for the sampled distribution gate (0: off)


def body(cfg: BenchConfig, arm: str, i: int) -> dict:
    b = {"model": cfg.model, "prompt": cfg.workload.prompt(i), "max_tokens": cfg.max_tokens,
         "temperature": cfg.temperature, "ignore_eos": cfg.workload.ignore_eos,
         "speculative": speculative(arm, cfg.gamma), **cfg.workload.extra}
    if cfg.temperature > 0:
        b["seed"] = cfg.seed + i
    return b


async def run_cell(http: httpx.AsyncClient, cfg: BenchConfig, arm: str, load: dict,
                   tick: Callable[[], None]) -> tuple[list[RequestResult], float]:
    """One arm at one load → results in request order, and the cell's wall time."""
    results: list[RequestResult | None] = [None] * cfg.requests
    started = time.perf_counter()

    async def one(i: int) -> None:
        results[i] = await complete(http, arm, body(cfg, arm, i), started)
        tick()

    if load["mode"] == "closed":
        order = iter(range(cfg.requests))

        async def worker() -> None:
            for i in order:
                await one(i)

        await asyncio.gather(*(worker() for _ in range(load["concurrency"])))
    else:
        rng, tasks = random.Random(cfg.seed), []
        for i in range(cfg.requests):
            await asyncio.sleep(rng.expovariate(load["rate"]))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return results, time.perf_counter() - started


async def metrics_now(http: httpx.AsyncClient) -> dict[str, float]:
    return scrape((await http.get("/metrics")).text)


def loads(cfg: BenchConfig) -> list[dict]:
    return ([{"mode": "closed", "concurrency": c} for c in cfg.concurrency]
            + [{"mode": "open", "rate": r} for r in cfg.rates])


async def run(cfg: BenchConfig, tick: Callable[[], None] = lambda: None) -> dict:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=600, limits=limits) as http:
        for i in range(2):  # warm-up: first requests pay for lazy initialisation
            await complete(http, "none", body(cfg, "none", i), time.perf_counter())
        cells, texts = [], {}
        for load in loads(cfg):
            for arm in cfg.arms:
                before = await metrics_now(http)
                results, duration = await run_cell(http, cfg, arm, load, tick)
                after = await metrics_now(http)
                texts[(arm, _key(load))] = [r.text if r.ok else None for r in results]
                cells.append({"arm": arm, "load": load, "summary": summarize(results, duration, cfg.slo),
                              "server": spec_decode(before, after),
                              "errors": sorted({r.error for r in results if not r.ok})[:5]})
        gates = {"greedy_identical": greedy_gate(cfg, texts) if cfg.temperature == 0 else {}}
        if cfg.dist_samples:
            gates["distribution"] = await distribution_gate(http, cfg, tick)
    return {"metadata": metadata(cfg), "cells": cells, "gates": gates}


def _key(load: dict) -> str:
    return f"c={load['concurrency']}" if load["mode"] == "closed" else f"rate={load['rate']}"


def greedy_gate(cfg: BenchConfig, texts: dict) -> dict[str, bool]:
    """Each greedy arm's outputs equal `none`'s at every load, request by request (no failures allowed)."""
    if "none" not in cfg.arms:
        return {}
    gate = {}
    for arm in cfg.arms:
        if arm != "none":
            pairs = [(texts[(arm, _key(load))], texts[("none", _key(load))]) for load in loads(cfg)]
            gate[arm] = all(a == b and None not in a for a, b in pairs)
    return gate


async def distribution_gate(http: httpx.AsyncClient, cfg: BenchConfig, tick) -> dict:
    """`dist_samples` T = 1 requests of one prompt per arm, 3 tokens each: the first comes from the prefill, the
    second from a cycle that may verify one draft (a cycle never drafts the request's last token), the third
    follows it. Each arm's outcomes against `none`'s; every arm has its own seeds, so the samples are
    independent (equal seeds could couple the arms' outcomes and hide a difference)."""
    async def outcomes(arm: str) -> list[str]:
        sem = asyncio.Semaphore(8)
        base = cfg.seed + 10_000 + 100_000 * cfg.arms.index(arm)

        async def one(i: int) -> str:
            async with sem:
                b = {**body(cfg, arm, 0), "max_tokens": 3, "temperature": 1.0, "seed": base + i}
                r = await complete(http, arm, b, time.perf_counter())
                tick()
                return r.text if r.ok else f"<error {r.error}>"

        return list(await asyncio.gather(*(one(i) for i in range(cfg.dist_samples))))

    if "none" not in cfg.arms:
        return {}
    reference = await outcomes("none")
    gate = {}
    for arm in (a for a in cfg.arms if a != "none"):
        before = await metrics_now(http)
        samples = await outcomes(arm)
        verified = spec_decode(before, await metrics_now(http))["draft_tokens"]  # the gate exercised drafts
        p = permutation_chi2(samples, reference, seed=cfg.seed)
        gate[arm] = {"p_value": p, "passed": p > GATE_P, "draft_tokens": verified}
    return gate


def permutation_chi2(a: list[str], b: list[str], rounds: int = 4000, seed: int = 0) -> float:
    """p-value that `a` and `b` come from one categorical distribution: χ² homogeneity statistic, its null
    distribution by shuffling the pooled labels (valid with the sparse counts of two-token outcomes)."""
    cats = {x: k for k, x in enumerate(sorted(set(a) | set(b)))}
    pooled = np.array([cats[x] for x in a + b])  # [n_a + n_b]
    n_a, k = len(a), len(cats)

    def stat(labels: np.ndarray) -> float:
        ca, cb = np.bincount(labels[:n_a], minlength=k), np.bincount(labels[n_a:], minlength=k)  # [k] each
        total = ca + cb
        ea, eb = total * n_a / len(labels), total * (len(labels) - n_a) / len(labels)
        return float(((ca - ea) ** 2 / ea).sum() + ((cb - eb) ** 2 / eb).sum())

    observed = stat(pooled)
    rng = np.random.default_rng(seed)
    hits = sum(stat(rng.permutation(pooled)) >= observed - 1e-9 for _ in range(rounds))
    return (hits + 1) / (rounds + 1)


def host_metadata() -> dict:
    """When, where and at which commit a run happened."""
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=False).stdout.strip()
    except OSError:
        git = ""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": f"{platform.machine()} {platform.node()}",
            "git": git}


def metadata(cfg: BenchConfig) -> dict:
    return {**host_metadata(), "model": cfg.model, "dataset": cfg.workload.name, "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature, "gamma": cfg.gamma, "requests_per_cell": cfg.requests,
            "seed": cfg.seed, "base_url": cfg.base_url,
            "slo": None if cfg.slo is None else {"ttft_ms": cfg.slo.ttft_ms, "tpot_ms": cfg.slo.tpot_ms,
                                                 "e2el_ms": cfg.slo.e2el_ms}}

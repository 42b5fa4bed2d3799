"""The three studies `dspark simulate` runs: validation against a bench run, scale-out, drafter:verifier ratio.

Validation replays every measured closed-loop cell (same arm, concurrency, request count and mean prompt/output
lengths) on one verifier and one drafter, and averages a few seeds. The scale study runs a GPU-like profile with
32 users per verifier; since placement is per verifier and least-loaded, N verifiers with 32·N clients are N
copies of one shard, so beyond `max_full` verifiers a shard of `shard` verifiers (with its share of drafters) is
simulated and its throughput multiplied (said in the results as `shards`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import time
from dataclasses import dataclass

from benchmarks.simulator.calibrate import SimCalibration, closed_cells
from benchmarks.simulator.engine import simulate
from benchmarks.simulator.model import Arm, Cluster, CostModel, SimResult, SimWorkload, StepProfile

VALIDATED = ("output_throughput", "per_user_tok_s_median")


@dataclass(slots=True)
class ValidationRow:
    arm: str
    concurrency: int
    measured: dict[str, float]  # output_throughput, per_user_tok_s_median, ttft_ms_mean, tau, mean_verify_len
    simulated: dict[str, float]

    def error(self, key: str) -> float:
        """Relative error of the simulation, (sim − measured) / measured."""
        m, s = self.measured.get(key), self.simulated.get(key)
        return (s - m) / m if m and s is not None and math.isfinite(s) else math.nan


def measured_of(cell: dict) -> dict[str, float]:
    s, v = cell["summary"], cell.get("server") or {}
    decode_tokens = s["total_output_tokens"] - s["completed"]
    cycles = v.get("verify_cycles") or decode_tokens
    return {"output_throughput": s["output_throughput"], "per_user_tok_s_median": s["per_user_tok_s_median"],
            "ttft_ms_mean": s["ttft_ms_mean"], "tau": decode_tokens / cycles,
            "mean_verify_len": v.get("mean_verify_len") or 0.0}


def simulate_cell(cell: dict, arm: Arm, cost: CostModel, seeds: int = 3, seed: int = 0) -> dict[str, float]:
    """One measured cell replayed on N = M = 1, metrics averaged over `seeds` runs."""
    s = cell["summary"]
    work = SimWorkload(round(s["total_input_tokens"] / s["completed"]),
                       round(s["total_output_tokens"] / s["completed"]),
                       clients=int(cell["load"]["concurrency"]), requests=int(s["completed"]))
    runs = [simulate(arm, cost, Cluster(1, 1), work, seed + i) for i in range(seeds)]
    keys = (*VALIDATED, "ttft_ms_mean", "tau", "mean_verify_len")
    return {k: statistics.fmean(getattr(r, k) for r in runs) for k in keys}


def validate(results: dict, cal: SimCalibration, cost: CostModel, seeds: int = 3, seed: int = 0) -> list[ValidationRow]:
    rows = []
    for cell in closed_cells(results):
        arm = cal.arms.get(cell["arm"])
        if arm is not None:
            rows.append(ValidationRow(cell["arm"], int(cell["load"]["concurrency"]), measured_of(cell),
                                      simulate_cell(cell, arm, cost, seeds, seed)))
    return rows


def score(rows: list[ValidationRow]) -> float:
    """Mean |log(sim / measured)| over both validated metrics of every cell (symmetric in over/under)."""
    logs = [abs(math.log1p(r.error(k))) for r in rows for k in VALIDATED if math.isfinite(r.error(k))]
    return statistics.fmean(logs) if logs else math.inf


def fit_globals(results: dict, cal: SimCalibration, profile: StepProfile, slopes=(0.0, 0.25, 0.5, 0.75, 1.0),
                contentions=(1.0, 1.2, 1.4, 1.6, 1.8, 2.0), seeds: int = 2) -> tuple[float, float, list[dict]]:
    """Grid search of the two global constants (drafter per-request slope, CPU contention) → (slope, contention,
    grid of scores). Only these two numbers move; every cell keeps the same constants."""
    grid = []
    for slope, contention in itertools.product(slopes, contentions):
        rows = validate(results, cal, cal.cost(profile, slope, contention), seeds)
        grid.append({"slope": slope, "contention": contention, "score": score(rows)})
    best = min(grid, key=lambda g: g["score"])
    return best["slope"], best["contention"], grid


# --- scale-out and ratio (GPU-like profile) ---------------------------------------------------------------------

@dataclass(slots=True)
class ScaleRow:
    arm: str
    verifiers: int
    drafters: int
    gpus: float
    clients: int
    throughput: float  # cluster steady-state output tok/s
    throughput_per_gpu: float
    per_user_tok_s: float
    ttft_ms: float
    tau: float
    mean_verify_len: float
    mean_budget: float
    shards: int  # 1: simulated in full; k: one shard simulated, throughput × k
    wall_s: float


def gpu_arms(arms: dict[str, Arm], gamma: int = 7) -> list[Arm]:
    """The scale study's policies with this machine's measured acceptance: none, mtp1, fixed γ, scheduled, and
    scheduled with the speculation cache where the bench measured its hit rate."""
    dspark = arms.get("dspark-fixed") or arms.get("dspark")
    out = [Arm("none", "none")]
    if "mtp1" in arms:
        out.append(arms["mtp1"])
    if dspark is not None:
        out.append(dataclasses.replace(dspark, name="dspark-fixed", policy="fixed", gamma=gamma))
        out.append(dataclasses.replace(dspark, name="dspark", policy="dspark", gamma=gamma))
        if arms.get("dspark-ahead") is not None and arms["dspark-ahead"].ahead_hit > 0:
            out.append(dataclasses.replace(dspark, name="dspark-ahead", policy="dspark", gamma=gamma,
                                           ahead_hit=arms["dspark-ahead"].ahead_hit))
    return out


def run_scale_point(arm: Arm, cost: CostModel, verifiers: int, ratio: float, users_per_verifier: int = 32,
                    rounds: int = 3, max_full: int = 100, shard: int = 10, drafter_gpu_share: float = 0.25,
                    prompt: int = 64, output: int = 64, seed: int = 0) -> ScaleRow:
    full = verifiers <= max_full
    sim_n = verifiers if full else shard
    shards = 1 if full else math.ceil(verifiers / shard)
    drafters = max(1, round(ratio * sim_n))
    clients = users_per_verifier * sim_n
    work = SimWorkload(prompt, output, clients=clients, requests=rounds * clients, stagger_s=_stagger(cost, output))
    started = time.perf_counter()
    r: SimResult = simulate(arm, cost, Cluster(sim_n, drafters, drafter_gpu_share), work, seed)
    wall = time.perf_counter() - started
    total_drafters = max(1, round(ratio * verifiers))
    gpus = verifiers + drafter_gpu_share * total_drafters
    tput = r.steady_throughput * verifiers / sim_n
    return ScaleRow(arm.name, verifiers, total_drafters, gpus, users_per_verifier * verifiers, tput, tput / gpus,
                    r.per_user_tok_s_median, r.ttft_ms_mean, r.tau, r.mean_verify_len, r.mean_budget, shards, wall)


def _stagger(cost: CostModel, output: int) -> float:
    """Spread client starts over about one plain request time, so steps do not march in lockstep."""
    return output * (cost.profile.step_s(1) + 2 * cost.hop_s + cost.router_s)


def scale_study(arms: list[Arm], cost: CostModel, sizes=(1, 10, 100, 1000), ratio: float = 0.25,
                **kw) -> list[ScaleRow]:
    return [run_scale_point(arm, cost, n, ratio, **kw) for arm in arms for n in sizes]


def ratio_study(arms: list[Arm], cost: CostModel, verifiers: int = 8, ratios=(0.125, 0.25, 0.5, 1.0, 2.0),
                **kw) -> list[ScaleRow]:
    return [run_scale_point(arm, cost, verifiers, r, **kw) for arm in arms for r in ratios]


def recommend_ratio(rows: list[ScaleRow], arm: str = "dspark", within: float = 0.05) -> dict:
    """Smallest M/N whose throughput is within `within` of the best for `arm` (and the per-GPU optimum)."""
    mine = sorted((r for r in rows if r.arm == arm), key=lambda r: r.drafters)
    if not mine:
        return {}
    best = max(r.throughput for r in mine)
    pick = next(r for r in mine if r.throughput >= (1 - within) * best)
    per_gpu = max(mine, key=lambda r: r.throughput_per_gpu)
    return {"arm": arm, "ratio": pick.drafters / pick.verifiers, "throughput": pick.throughput,
            "best_throughput": best, "best_per_gpu_ratio": per_gpu.drafters / per_gpu.verifiers,
            "best_per_gpu": per_gpu.throughput_per_gpu}

"""`dspark simulate`: the cluster simulator — validation against a bench run, scale-out, drafter:verifier ratio."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

GPU_PROFILE = Path(__file__).resolve().parent.parent / "benchmarks" / "simulator" / "profiles" / "gpu-example.json"


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="discrete-event cluster simulator: validate on a bench run, scale, ratio")
    p.add_argument("--bench", type=Path, default=Path("benchmarks/results/serving-cpu/results.json"),
                   help="`dspark bench` results.json to calibrate and validate against")
    p.add_argument("--profile", type=Path, default=Path("benchmarks/results/sps-cpu.json"),
                   help="the bench machine's verifier SPS profile (`dspark profile --json`)")
    p.add_argument("--validate", action="store_true", help="simulate every measured cell (N = M = 1)")
    p.add_argument("--scale", action="store_true", help="N ∈ --sizes verifiers on --gpu-profile, 32 users each")
    p.add_argument("--ratio", action="store_true", help="sweep drafter:verifier replicas at --ratio-verifiers")
    p.add_argument("--gpu-profile", type=Path, default=GPU_PROFILE, help="SPS profile of the scale studies")
    p.add_argument("--verifier-speed", type=float, default=1.0, help="scale the scale studies' step times by 1/x")
    p.add_argument("--sizes", default="1,10,100,1000")
    p.add_argument("--users-per-verifier", type=int, default=32)
    p.add_argument("--drafter-ratio", type=float, default=0.25, help="M/N of the scale study")
    p.add_argument("--drafter-gpu-share", type=float, default=0.25, help="GPUs one drafter replica occupies")
    p.add_argument("--ratio-verifiers", type=int, default=8)
    p.add_argument("--ratios", default="0.125,0.25,0.5,1,2")
    p.add_argument("--gamma", type=int, default=7, help="γ of the scale studies' fixed and scheduled arms")
    p.add_argument("--rounds", type=int, default=3, help="requests per client in the scale studies")
    p.add_argument("--max-full", type=int, default=100, help="largest N simulated in full; beyond, one shard")
    p.add_argument("--shard", type=int, default=10, help="verifiers per simulated shard beyond --max-full")
    p.add_argument("--router-ms", type=float, default=1.0, help="router work per cycle in the scale studies")
    p.add_argument("--gather-every-step", action="store_true", help="what-if: the verifier gathers before every "
                   "step (batch window), not only when idle")
    p.add_argument("--no-fit", action="store_true", help="skip the global fit (slope 0, no contention)")
    p.add_argument("--seeds", type=int, default=3, help="seeds averaged per validation cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("build/simulate"))


def run_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from benchmarks.simulator import calibrate as calib
    from benchmarks.simulator import report, studies
    from benchmarks.simulator.model import StepProfile

    console = Console()
    everything = not (args.validate or args.scale or args.ratio)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    profile = StepProfile.load(args.profile)
    results = calib.load_results(args.bench)
    cal = calib.calibrate(results, profile)
    doc: dict = {"about": _about(args), "inputs": {"bench": str(args.bench), "profile": str(args.profile),
                                                   "cells": len(calib.closed_cells(results))},
                 "calibration": _calibration_json(cal), "wall_s": {}}
    images = []
    slope, contention, fit = 0.0, 1.0, "none (--no-fit)"
    if (everything or args.validate) and not args.no_fit:
        started = time.perf_counter()
        slope, contention, grid = studies.fit_globals(results, cal, profile)
        doc["fit_grid"], fit = grid, "grid search over all cells"
        doc["wall_s"]["fit"] = time.perf_counter() - started
    if everything or args.validate:
        started = time.perf_counter()
        rows = studies.validate(results, cal, cal.cost(profile, slope, contention), args.seeds, args.seed)
        doc["wall_s"]["validate"] = time.perf_counter() - started
        doc["validation"] = report.validation_json(rows)
        doc["globals"] = {"slope": slope, "contention": contention, "fit": fit, "score": studies.score(rows)}
        images.append(report.plot_validation(rows, args.out_dir / "validation.png"))
    if everything or args.scale or args.ratio:
        cost, arms = _gpu_cost(args, cal), studies.gpu_arms(cal.arms, args.gamma)
        kw = {"users_per_verifier": args.users_per_verifier, "rounds": args.rounds, "max_full": args.max_full,
              "shard": args.shard, "drafter_gpu_share": args.drafter_gpu_share, "seed": args.seed}
        if everything or args.scale:
            started = time.perf_counter()
            sizes = [int(x) for x in args.sizes.split(",") if x]
            scale = studies.scale_study(arms, cost, sizes, args.drafter_ratio, **kw)
            doc["wall_s"]["scale"] = time.perf_counter() - started
            doc["scale"] = report.rows_json(scale)
            images.append(report.plot_scale(scale, args.out_dir / "scale.png"))
        if everything or args.ratio:
            started = time.perf_counter()
            ratios = [float(x) for x in args.ratios.split(",") if x]
            sweep = studies.ratio_study([a for a in arms if a.policy in ("fixed", "dspark")], cost,
                                        args.ratio_verifiers, ratios, **kw)
            doc["wall_s"]["ratio"] = time.perf_counter() - started
            doc["ratio"], doc["recommendation"] = report.rows_json(sweep), studies.recommend_ratio(sweep)
            images.append(report.plot_ratio(sweep, args.out_dir / "ratio.png"))
    (args.out_dir / "simulate.json").write_text(json.dumps(doc, indent=1, default=float))
    (args.out_dir / "simulate.md").write_text(report.markdown(doc, images))
    console.print(report.markdown(doc, []))
    console.print(f"results in {args.out_dir}/: simulate.json, simulate.md, {', '.join(p.name for p in images)}")
    return 0


def _gpu_cost(args: argparse.Namespace, cal):
    """The scale studies' cost model: the GPU profile (its `drafter` entry, else 10 % of a step), the calibrated
    hop, `--router-ms`, no CPU contention (dedicated GPUs)."""
    from benchmarks.simulator.model import CostModel, DraftCost, StepProfile

    profile = StepProfile.load(args.gpu_profile, args.verifier_speed)
    spec = json.loads(args.gpu_profile.read_text()).get("drafter") or {}
    base = spec.get("base_ms", 0.1 * profile.step_s(1) * 1000.0) / 1000.0 / args.verifier_speed
    per_request = spec.get("per_request_ms", 0.0) / 1000.0 / args.verifier_speed
    return CostModel(profile, {"default": DraftCost(base, per_request)}, cal.hop_s, args.router_ms / 1000.0,
                     gather_every_step=args.gather_every_step)


def _calibration_json(cal) -> dict:
    return {"hop_s": cal.hop_s, "router_s": cal.router_s, "prefill_extra_s": cal.ttft_offset_s,
            "draft_s": cal.draft_s, "working": cal.working, "prompt_tokens": cal.prompt_tokens,
            "output_tokens": cal.output_tokens,
            "arms": {n: {"policy": a.policy, "method": a.method, "gamma": a.gamma, "accept": list(a.accept)}
                     for n, a in cal.arms.items()}}


def _about(args: argparse.Namespace) -> str:
    return ("Discrete-event model of a dspark cluster (benchmarks/simulator). Validation calibrates on "
            f"{args.bench} with {args.profile}; the scale studies use {args.gpu_profile.name}, an ILLUSTRATIVE "
            "(not measured) GPU profile, with this machine's measured acceptance. Beyond --max-full verifiers one "
            "shard is simulated and multiplied (placement is per verifier, so shards are independent).")

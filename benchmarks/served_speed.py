"""Served against in-process: what the HTTP → router → gRPC → verifier path keeps of the engine's speed.

One run, alternating rounds, batch 1, greedy, the shipped target, the same prompts and token counts:
  in-process — `InProcessRouter` over an `Engine` in this process (what `dspark generate` does);
  served     — a verifier process and a router process (`python -m cli.main verifier|router`, the processes
               `dspark serve` runs as Ray actors and its main process), an OpenAI streaming client here
               (httpx, SSE), one request at a time.
Decode speed of a request = (tokens − 1) / (time from its first token to its last), so prefill and TTFT
are out of both arms; served TTFT is reported separately. The served arm runs plain decoding (`method: none`)
and, with `--drafted`, the shipped DSpark drafter (a drafter process too) against in-process DSpark.

    python benchmarks/served_speed.py [--model dspark-target] [--rounds 3] [--max-tokens 96] [--threads 2]
        [--drafted] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx
import torch

from benchmarks.harness import cpu_model
from cluster.launcher import start_tiers, stop_tiers
from drafter_worker.main import drafter_service
from drafter_worker.settings import DrafterSettings
from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from router.settings import RouterSettings
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from verifier_worker.main import verifier_service
from verifier_worker.settings import VerifierSettings

PROMPTS = ["def fibonacci(n):", "import os\n\n", "class Stack:\n    def push(self, item):", "for i in range(10):",
           "The quick brown fox", "def main():\n"]


def in_process(args, policy: Policy) -> list[float]:
    """Decode tok/s of each prompt, engine and drafter in this process."""
    verifier = verifier_service(VerifierSettings(model=args.model, threads=args.threads, num_slots=1, max_len=512))
    drafter = None if policy is Policy.NONE else drafter_service(
        DrafterSettings(model=args.model, drafters=[f"{args.model}-dspark"])).proposers["dspark"]
    router = InProcessRouter(verifier.engine, drafter, policy, 7)
    tok = TextTokenizer.from_dir(resolve_model(args.model))
    speeds = []
    for i, prompt in enumerate(PROMPTS):
        stamps: list[float] = []
        req = GenerationRequest(f"p{i}", tok.encode(prompt), SamplingParams(max_tokens=args.max_tokens), ())
        router.generate([req], on_tokens=lambda rid, new, s=stamps: s.extend([time.perf_counter()] * len(new)))
        speeds.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return speeds


def served(url: str, args, method: str) -> tuple[list[float], list[float]]:
    """Decode tok/s and TTFT (s) of each prompt over the OpenAI streaming API."""
    speeds, ttfts = [], []
    with httpx.Client(base_url=url, timeout=120) as client:
        for prompt in PROMPTS:
            body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "speculative": {"method": method}}
            sent, stamps = time.perf_counter(), []
            with client.stream("POST", "/v1/completions", json=body) as reply:
                reply.raise_for_status()
                for line in reply.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        stamps.append(time.perf_counter())
            ttfts.append(stamps[0] - sent)
            # One SSE event per cycle (plain: per verifier reply, stream_interval tokens); max_tokens in all.
            speeds.append((args.max_tokens - 1) / (stamps[-1] - stamps[0]))
    return speeds, ttfts


def wait_healthy(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"router at {url} did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dspark-target", help="shipped target (its -dspark drafter with --drafted)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the engine in both arms")
    parser.add_argument("--plain-depth", type=int, default=RouterSettings.model_fields["plain_depth"].default,
                        help="the router's plain_depth (0: one verifier step per call)")
    parser.add_argument("--stream-interval", type=int, default=RouterSettings.model_fields["stream_interval"].default,
                        help="the router's stream_interval (tokens per verifier reply of a plain request)")
    parser.add_argument("--drafted", action="store_true", help="also the DSpark arm (a drafter process, 1 thread)")
    parser.add_argument("--json", default="benchmarks/results/served-speed-cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    roles = [("verifier", VerifierSettings(model=args.model, port=0, threads=args.threads, num_slots=4, max_len=512))]
    if args.drafted:
        roles.append(("drafter", DrafterSettings(model=args.model, port=0, threads=1,
                                                 drafters=[f"{args.model}-dspark"])))
    tiers = start_tiers(roles)
    drafted = {"drafter": tiers[1].address, "methods": ["dspark"], "method": "dspark", "policy": "fixed"} \
        if args.drafted else {"drafter": None, "method": "none", "policy": "none"}
    router_settings = RouterSettings(model=args.model, port=0, verifier=tiers[0].address, max_model_len=512,
                                     plain_depth=args.plain_depth, stream_interval=args.stream_interval, **drafted)
    tiers += start_tiers([("router", router_settings)])
    url = f"http://{tiers[-1].address}"
    arms = {"plain": (Policy.NONE, "none")} | ({"dspark": (Policy.FIXED, "dspark")} if args.drafted else {})
    per: dict[str, list[float]] = {}
    try:
        wait_healthy(url)
        for _, method in arms.values():
            served(url, args, method)  # warm-up
        for _ in range(args.rounds):  # the arms alternate, so a slow spell of this VM hits them alike
            for name, (policy, method) in arms.items():
                per.setdefault(f"{name}_in_process", []).append(statistics.median(in_process(args, policy)))
                speeds, ttfts = served(url, args, method)
                per.setdefault(f"{name}_served", []).append(statistics.median(speeds))
                per.setdefault(f"{name}_served_ttft_ms", []).append(1000 * statistics.median(ttfts))
    finally:
        stop_tiers(tiers)
    med = {k: round(statistics.median(v), 2) for k, v in per.items()}
    ratios = {f"{name}_served_over_in_process": round(med[f"{name}_served"] / med[f"{name}_in_process"], 3)
              for name in arms}
    for name in arms:
        print(f"{name:>6}: in-process {med[f'{name}_in_process']:7.1f} tok/s   served {med[f'{name}_served']:7.1f} "
              f"tok/s   served / in-process {ratios[f'{name}_served_over_in_process']:.2f}   "
              f"served TTFT {med[f'{name}_served_ttft_ms']:.1f} ms")
    meta = {"machine": cpu_model(), "model": args.model, "threads": args.threads,
            "torch": torch.__version__, "max_tokens": args.max_tokens,
            "plain_depth": args.plain_depth, "stream_interval": args.stream_interval, "prompts": len(PROMPTS),
            "dtype": "auto"}
    with open(args.json, "w") as f:
        json.dump({**meta, "medians": med, **ratios, "rounds": per}, f, indent=2)

if __name__ == "__main__":
    main()

"""The engine at the machine's limit: eager against compiled steps, plain and speculative, in one run.

For the shipped target (or any model directory), in the default dtype of this machine, batch 1 and 8,
greedy, on the eval prompts of benchmarks/datasets/v2 (those of acceptance-v2.md; `--datasets-dir`), each
request stopping at the model's end of sequence as a user's would (`--ignore-eos`: always `--tokens`):

- plain decoding tokens/s per mode (eager, compiled), rounds alternating between the modes;
- forward(n) / forward(1) for n = 1..64 new tokens after 256 cached, per mode;
- each shipped drafter (or `--drafters arm=dir`) at fixed γ, tokens/s against plain decoding of the same mode
  in alternating rounds, batch 1, greedy or at `--temperature` (seeded), and what its block costs against a
  target forward(1) (compiled mode also compiles a block drafter's greedy blocks; one warm-up request pays
  that compile before timing).

Every figure is a ratio against a baseline measured in this run; the JSON also carries the CPU model and
whether bf16 is native. `python benchmarks/engine_speed.py [--model dspark-target] [--json out.json]`
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from drafter_worker.checkpoint import drafter_config, load_drafter
from drafter_worker.drafter import Drafter
from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.loader import load_model, native_bf16
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from verifier_worker.engine import Engine, EngineConfig
from verifier_worker.kv_cache import KVCache
from verifier_worker.profile import profile_sps, time_forward

DATASETS = Path(__file__).parent / "datasets" / "v2"
DOMAINS = ("code", "math", "chat")
SUFFIXES = {"mtp1": "mtp", "eagle3": "eagle3", "dflash": "dflash", "dspark": "dspark"}  # arm → drafter dir suffix
DRAFTERS = {arm: f"dspark-target-{suffix}" for arm, suffix in SUFFIXES.items()}  # the shipped target's drafters


def drafter_dirs(spec: str, model: str) -> dict[str, Path]:
    """`--drafters`: a comma list of arms (`dspark`: the shipped `<model>-dspark`) or `arm=directory`."""
    dirs = {}
    for item in filter(None, spec.split(",")):
        name, _, path = item.partition("=")
        if name not in SUFFIXES:
            raise SystemExit(f"--drafters: unknown arm {name!r} (one of {', '.join(SUFFIXES)})")
        dirs[name] = Path(path) if path else resolve_model(f"{model}-{SUFFIXES[name]}")
    return dirs


def cpu_model() -> str:
    """The CPU's model name and its bf16-relevant flags (figures differ with AMX, AVX512-BF16 or AVX2 only)."""
    name, flags = platform.processor() or platform.machine(), set()
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    wanted = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return f"{name} ({' '.join(wanted)})" if wanted else name


def prompts(tokenizer: TextTokenizer, datasets_dir: Path, n: int) -> list[list[int]]:
    """n // 3 prompts of each domain, interleaved (code, math, chat, code, ...), their last 200 tokens."""
    per_domain = []
    for name in DOMAINS:
        lines = (datasets_dir / f"{name}.jsonl").read_text().splitlines()
        per_domain.append([json.loads(line)["prompt"] for line in lines[: max(1, n // 3)]])
    texts = [t for row in zip(*per_domain, strict=True) for t in row]
    return [tokenizer.encode(t)[-200:] for t in texts[:n]]


@dataclass(slots=True)
class Stopping:
    """How a benchmark request ends: `tokens` new tokens at most, earlier at one of `stop_ids` (none: never)."""

    tokens: int
    stop_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class Rate:
    """What a run of `generate_tps` emitted and how fast; τ = cycle tokens per verify cycle (0: no cycles)."""

    tokens_per_s: float
    tokens: int
    cycles: int
    cycle_tokens: int

    @property
    def tau(self) -> float:
        return self.cycle_tokens / self.cycles if self.cycles else 0.0


def generate_tps(engine: Engine, proposer, policy: Policy, gamma: int, ids: list[list[int]], stopping: Stopping,
                 batch: int, temperature: float = 0.0, sps: list[tuple[int, float]] | None = None) -> Rate:
    router = InProcessRouter(engine, proposer, policy, gamma, sps=sps)
    reqs = [GenerationRequest(f"p{i}", p, SamplingParams(max_tokens=stopping.tokens, temperature=temperature,
                                                         seed=i if temperature else None), stopping.stop_ids)
            for i, p in enumerate(ids)]
    started, results = time.perf_counter(), []
    for first in range(0, len(reqs), batch):
        results += router.generate(reqs[first : first + batch])
    tokens = sum(len(r.token_ids) for r in results)
    return Rate(tokens / (time.perf_counter() - started), tokens, sum(r.cycles for r in results),
                sum(r.cycle_tokens for r in results))


class TimedProposer:
    """A drafter with the wall time of its calls (`propose`: a block; `commit`: folding features) summed, so a
    run can say what a block costs against a target step."""

    def __init__(self, drafter: Drafter):
        self.drafter, self.blocks, self.propose_s, self.commit_s = drafter, 0, 0.0, 0.0

    def propose(self, contexts, gamma, params):
        started = time.perf_counter()
        blocks = self.drafter.propose(contexts, gamma, params)
        self.propose_s += time.perf_counter() - started
        self.blocks += len(blocks)
        return blocks

    def commit(self, request_id, feature_start, features):
        started = time.perf_counter()
        self.drafter.commit(request_id, feature_start, features)
        self.commit_s += time.perf_counter() - started

    def release(self, request_id):
        self.drafter.release(request_id)

    def per_block_ms(self) -> dict[str, float]:
        n = max(1, self.blocks)
        return {"propose_ms": round(1000 * self.propose_s / n, 3), "commit_ms": round(1000 * self.commit_s / n, 3)}


def forward_curve(engine: Engine, sizes: list[int], rounds: int) -> dict[int, float]:
    model = engine.forward
    cache = KVCache(model.config, 2, 256 + max(sizes), model.dtype, model.device)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for n in sizes:
        time_forward(model, cache, [n], 256, 2)
    for _ in range(rounds):
        for n in sizes:
            times[n] += time_forward(model, cache, [n], 256, 1)
    return {n: 1000 * statistics.median(t) for n, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dspark-target")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request at most")
    p.add_argument("--datasets-dir", type=Path, default=DATASETS, help="code/math/chat.jsonl eval prompts")
    p.add_argument("--ignore-eos", action="store_true", help="generate --tokens past the end of sequence")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--temperature", type=float, default=0.0, help="of the speculative arms and their plain rounds")
    p.add_argument("--policy", default="fixed", choices=["fixed", "threshold", "dspark"],
                   help="verify length of the speculative arms (mtp1: always its one draft); dspark plans against "
                        "the engine's SPS profile, measured at start")
    p.add_argument("--drafters", default=",".join(DRAFTERS),
                   help="comma list of arms (the model's shipped drafters) or arm=directory ('' for none)")
    p.add_argument("--json")
    args = p.parse_args()
    modes = args.modes.split(",")
    model_dir = resolve_model(args.model)
    tok = TextTokenizer.from_dir(model_dir)
    ids = prompts(tok, args.datasets_dir, args.prompts)
    stopping = Stopping(args.tokens, () if args.ignore_eos else tok.eos_token_ids)
    dirs = drafter_dirs(args.drafters, args.model)
    taps = {m: drafter_config(d).tap_layers for m, d in dirs.items()}
    all_taps = tuple(sorted({t for ts in taps.values() for t in ts}))
    model = load_model(model_dir, args.dtype, tap_layers=all_taps)
    meta = {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "cpu": cpu_model(),
            "native_bf16": native_bf16(torch.device("cpu")), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "dtype": str(model.dtype).removeprefix("torch.")}
    print(json.dumps(meta))
    engines = {}
    for mode in modes:
        started = time.perf_counter()
        engines[mode] = Engine(model, EngineConfig(num_slots=8, max_len=1024, compile=mode == "compiled"))
        print(f"{mode}: engine ready in {time.perf_counter() - started:.1f} s", flush=True)
    plain: dict[str, dict[int, list[float]]] = {m: {1: [], 8: []} for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            for batch in (1, 8):
                ids_b = ids if batch == 1 else (ids * 8)[:8]
                # the engine at a constant batch: every request runs its --tokens (no end of sequence)
                plain[mode][batch].append(
                    generate_tps(engines[mode], None, Policy.NONE, 0, ids_b, Stopping(args.tokens), batch).tokens_per_s)
    results = {"meta": meta, "plain": {}, "forward_ms": {}, "speculative": {}}
    for mode in modes:
        results["plain"][mode] = {b: round(statistics.median(v), 1) for b, v in plain[mode].items()}
        curve = forward_curve(engines[mode], [1, 2, 4, 8, 16, 32, 64], 10)
        results["forward_ms"][mode] = {n: round(ms, 3) for n, ms in curve.items()}
        print(f"{mode}: plain b1 {results['plain'][mode][1]} tok/s, b8 {results['plain'][mode][8]} tok/s; "
              f"forward(8)/forward(1) {curve[8] / curve[1]:.2f}; forward(n) ms {results['forward_ms'][mode]}",
              flush=True)
    policy = Policy(args.policy)
    sps = None
    if policy is Policy.DSPARK:
        sps = [(point.batch_tokens, point.step_ms) for point in profile_sps(model)]
        results["sps"] = sps
    for name in taps:
        draft_model, calibration = load_drafter(dirs[name], model, args.dtype)
        for mode in modes:
            drafter = Drafter(draft_model, calibration, compile=mode == "compiled")
            gamma, arm = (1, Policy.FIXED) if name == "mtp1" else (args.gamma, policy)
            warm = Stopping(16)
            generate_tps(engines[mode], drafter, arm, gamma, ids[:1], warm, 1, sps=sps)  # warm-up (and compile)
            timed = TimedProposer(drafter)
            first = generate_tps(engines[mode], timed, arm, gamma, ids, stopping, 1, args.temperature, sps)
            plain_tps, spec_tps = [], []
            for _ in range(args.rounds):  # alternating, so a slow spell of the VM hits both alike
                t = args.temperature
                plain_tps.append(generate_tps(engines[mode], None, Policy.NONE, 0, ids, stopping, 1, t).tokens_per_s)
                spec_tps.append(generate_tps(engines[mode], drafter, arm, gamma, ids, stopping, 1, t, sps).tokens_per_s)
            base, tps = statistics.median(plain_tps), statistics.median(spec_tps)
            block = timed.per_block_ms()
            block_x = block["propose_ms"] / results["forward_ms"][mode][1]
            results["speculative"].setdefault(name, {})[mode] = {"tokens_per_s": round(tps, 1),
                                                                 "plain_tokens_per_s": round(base, 1),
                                                                 "x_plain": round(tps / base, 2), **block,
                                                                 "block_x_step": round(block_x, 2),
                                                                 "tau": round(first.tau, 3), "tokens": first.tokens}
            print(f"{name} {mode}: {tps:.1f} tok/s against plain {base:.1f} in the same rounds = {tps / base:.2f} x; "
                  f"τ {first.tau:.2f} over {first.tokens} tokens; a block {block} = {block_x:.2f} x a target "
                  f"forward(1)", flush=True)
    if len(modes) > 1:
        results["compiled_x_eager"] = {b: round(results["plain"]["compiled"][b] / results["plain"]["eager"][b], 2)
                                       for b in (1, 8)}
        print("compiled / eager plain decoding:", results["compiled_x_eager"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""The engine-speed harness the experiments share: what machine ran them, the target loaded once with the taps its
drafters read, the eval prompts, timed generation through the one cycle loop (`InProcessRouter`), forward timings,
rounds alternating between arms, and the JSON they print.

`engine.py`, `engine_speed.py`, `peers.py` and `gpu_check.py` each time the engine through these, so a figure in
one is measured the way it is in the others: every speed is a median over rounds that alternate between the arms
compared (a slow spell of this noisy VM hits them alike), after a warm-up round that also pays any compile.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from drafter_worker.checkpoint import drafter_config
from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.loader import cpu_model, load_model, native_bf16
from services.model import CausalLM
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import SamplingParams
from verifier_worker.engine import Engine
from verifier_worker.kv_cache import KVCache
from verifier_worker.profile import time_forward

DATASETS = Path(__file__).parent / "datasets" / "v2"
DOMAINS = ("code", "math", "chat")
SUFFIXES = {"mtp1": "mtp", "eagle3": "eagle3", "dflash": "dflash", "dspark": "dspark"}  # arm → drafter dir suffix
DRAFTERS = {arm: f"dspark-target-{suffix}" for arm, suffix in SUFFIXES.items()}  # the shipped target's drafters
FORWARD_SIZES = (1, 2, 4, 8, 16, 32, 64)  # new tokens per forward: decode, verify blocks, prefill chunks


def machine(device: torch.device | None = None) -> dict:
    """What every figure is printed beside: the device (the CPU with its bf16 flags), threads, torch."""
    device = device or torch.device("cpu")
    facts = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    if device.type == "cuda":
        return facts | {"device": torch.cuda.get_device_name(device), "devices": torch.cuda.device_count(),
                        "cuda": torch.version.cuda}
    return facts | {"device": facts["cpu"], "devices": 1, "native_bf16": native_bf16(device)}


def drafter_dirs(spec: str, model: str) -> dict[str, Path]:
    """`--drafters`: a comma list of arms (`dspark`: the shipped `<model>-dspark`) or `arm=directory`."""
    dirs = {}
    for item in filter(None, spec.split(",")):
        name, _, path = item.partition("=")
        if name not in SUFFIXES:
            raise SystemExit(f"--drafters: unknown arm {name!r} (one of {', '.join(SUFFIXES)})")
        dirs[name] = Path(path) if path else resolve_model(f"{model}-{SUFFIXES[name]}")
    return dirs


@dataclass(slots=True)
class Target:
    """A loaded target: its weights with every tap its drafters read, its directory and tokenizer."""

    model: CausalLM
    model_dir: Path
    tokenizer: TextTokenizer
    drafters: dict[str, Path] = field(default_factory=dict)  # arm → drafter directory

    @property
    def dtype_name(self) -> str:
        return str(self.model.dtype).removeprefix("torch.")


def load_target(name: str, dtype: str = "auto", device: torch.device | None = None,
                drafters: dict[str, Path] | None = None) -> Target:
    """The target `name` (shipped model or directory) once, with the union of its drafters' tap layers."""
    model_dir, drafters = resolve_model(name), drafters or {}
    taps = tuple(sorted({t for d in drafters.values() for t in drafter_config(d).tap_layers}))
    model = load_model(model_dir, dtype, device or "cpu", tap_layers=taps)
    return Target(model, model_dir, TextTokenizer.from_dir(model_dir), drafters)


def eval_prompts(tokenizer: TextTokenizer, datasets_dir: Path, n: int) -> list[list[int]]:
    """n // 3 prompts of each domain, interleaved (code, math, chat, code, ...), their last 200 tokens."""
    per_domain = []
    for name in DOMAINS:
        lines = (datasets_dir / f"{name}.jsonl").read_text().splitlines()
        per_domain.append([json.loads(line)["prompt"] for line in lines[: max(1, n // 3)]])
    texts = [t for row in zip(*per_domain, strict=True) for t in row]
    return [tokenizer.encode(t)[-200:] for t in texts[:n]]


def random_prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n prompts of `length` ids drawn from [3, vocab), seeded (a model without a tokenizer, or no text bias)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


@dataclass(slots=True)
class Stopping:
    """How a benchmark request ends: `tokens` new tokens at most, earlier at one of `stop_ids` (none: never)."""

    tokens: int
    stop_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class Rate:
    """What a run of `generate_rate` emitted and how fast; τ = cycle tokens per verify cycle (0: no cycles)."""

    tokens_per_s: float
    tokens: int
    cycles: int
    cycle_tokens: int
    outputs: list[list[int]]  # each request's new token ids, in prompt order

    @property
    def tau(self) -> float:
        return self.cycle_tokens / self.cycles if self.cycles else 0.0


def generate_rate(engine: Engine, ids: Sequence[list[int]], stopping: Stopping, proposer=None,
                  policy: Policy = Policy.NONE, gamma: int = 0, batch: int = 1, temperature: float = 0.0,
                  sps: list[tuple[int, float]] | None = None) -> Rate:
    """Generate a continuation of every prompt, `batch` requests at a time, through the one cycle loop; seeded
    at T > 0 so arms compared see the same draws."""
    router = InProcessRouter(engine, proposer, policy, gamma, sps=sps)
    reqs = [GenerationRequest(f"p{i}", list(p), SamplingParams(max_tokens=stopping.tokens, temperature=temperature,
                                                               seed=i if temperature else None), stopping.stop_ids)
            for i, p in enumerate(ids)]
    _sync(engine.model.device)
    started, results = time.perf_counter(), []
    for first in range(0, len(reqs), batch):
        results += router.generate(reqs[first : first + batch])
    _sync(engine.model.device)
    tokens = sum(len(r.token_ids) for r in results)
    return Rate(tokens / (time.perf_counter() - started), tokens, sum(r.cycles for r in results),
                sum(r.cycle_tokens for r in results), [r.token_ids for r in results])


def alternate(arms: dict[str, Callable[[], float]], rounds: int, warm_up: int = 1) -> dict[str, list[float]]:
    """Each arm's measurement over `rounds` rounds, the arms taking turns within a round; `warm_up` rounds first,
    not kept (they pay compiles and first-touch costs)."""
    for _ in range(warm_up):
        for measure in arms.values():
            measure()
    samples: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, measure in arms.items():
            samples[name].append(measure())
    return samples


def medians(samples: dict, digits: int = 1) -> dict:
    return {name: round(statistics.median(values), digits) for name, values in samples.items()}


def forward_ms(model: CausalLM, sizes: Sequence[int], context: int, rounds: int, batch: int = 1) -> dict[int, float]:
    """Median ms of one forward of n new tokens for each of `batch` sequences after `context` cached ones (a
    verify step of n - 1 drafts), for each n in `sizes`, the sizes alternating round by round."""
    cache = KVCache(model.config, batch, context + max(sizes), model.dtype, model.device)
    arms = {n: (lambda n=n: time_forward(model, cache, [n] * batch, context, 1)[0]) for n in sizes}
    return {n: round(1000 * statistics.median(t), 3) for n, t in alternate(arms, rounds, warm_up=2).items()}


def write_json(path: str | Path | None, record: dict) -> None:
    """The record every experiment leaves (its `meta` carries `machine()`), when `--json` asked for one."""
    if path:
        Path(path).write_text(json.dumps(record, indent=2) + "\n")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

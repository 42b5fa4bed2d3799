"""SPS(B): verifier engine steps per second at B batch tokens (docs/design.md §5).

Each point times one forward of B new tokens spread over ceil(B / tokens_per_request) requests,
each with `context` tokens already cached and logits wanted at every new token (a verify step).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from services.layers import RaggedLayout
from services.loader import cpu_model
from services.model import CausalLM
from services.settings import cache_dir
from verifier_worker.kv_cache import KVCache

DEFAULT_BATCH_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True, slots=True)
class SpsPoint:
    batch_tokens: int
    requests: int
    step_ms: float  # median wall time of one forward
    sps: float  # steps per second = 1000 / step_ms
    tokens_per_s: float  # batch_tokens * sps

    def as_dict(self) -> dict:
        return asdict(self)


def time_forward(model: CausalLM, cache: KVCache, lens: list[int], context: int, repeats: int) -> list[float]:
    """Wall seconds of `repeats` forwards, request r feeding lens[r] tokens after `context` cached ones."""
    n = sum(lens)
    dev = model.device
    layout = RaggedLayout(slots=list(range(len(lens))), starts=[context] * len(lens), lens=lens)
    ids = torch.randint(0, model.config.vocab_size, (n,), device=dev)
    positions = torch.cat([torch.arange(context, context + k, device=dev) for k in lens])
    rows = torch.arange(n, device=dev)
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids, positions, layout, cache.k, cache.v, rows)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return times


def split_tokens(batch_tokens: int, tokens_per_request: int) -> list[int]:
    full, rest = divmod(batch_tokens, tokens_per_request)
    return [tokens_per_request] * full + ([rest] if rest else [])


def profile_sps(
    model: CausalLM,
    batch_tokens: tuple[int, ...] = DEFAULT_BATCH_TOKENS,
    context: int = 512,
    tokens_per_request: int = 8,
    repeats: int = 10,
) -> list[SpsPoint]:
    max_requests = max(math.ceil(b / tokens_per_request) for b in batch_tokens)
    cache = KVCache(model.config, max_requests, context + tokens_per_request, model.dtype, model.device)
    points = []
    for b in batch_tokens:
        lens = split_tokens(b, tokens_per_request)
        time_forward(model, cache, lens, context, 2)  # warm-up
        step_ms = 1000 * statistics.median(time_forward(model, cache, lens, context, repeats))
        points.append(SpsPoint(b, len(lens), round(step_ms, 3), round(1000 / step_ms, 2),
                               round(b * 1000 / step_ms, 1)))
    return points


def host_sps(forward: CausalLM, fingerprint: dict, **kw) -> list[SpsPoint]:
    """`profile_sps(forward, **kw)` as this host measured it before for the same `fingerprint` (what the speed
    depends on: the model's files, dtype, device, threads, torch, the CPU, this code), else measured now and kept. A
    verifier restarted after a fault, or one more replica of a pool on this host, then serves seconds sooner
    (2 s on the toy target at two vCPUs; every start of the suite's tiers paid it)."""
    key = {**fingerprint, "torch": torch.__version__, "cpu": cpu_model(), "code": _code(), "profile": kw}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    path = cache_dir("sps") / f"{digest}.json"
    try:
        return [SpsPoint(**p) for p in json.loads(path.read_text())["points"]]
    except (OSError, ValueError, TypeError, KeyError):
        pass  # none yet, or unreadable: measure
    points = profile_sps(forward, **kw)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps({"key": key, "points": [p.as_dict() for p in points]}, indent=1, default=str))
    partial.replace(path)  # atomic: a replica starting beside this one reads the whole table or none
    return points



@functools.cache
def _code() -> str:
    """A digest of the serving code whose speed a table measures (the engine, the model, the CPU kernels): a
    new version of either measures anew."""
    root = Path(__file__).parent.parent
    digest = hashlib.sha256()
    kernels = [p for p in (root / "services" / "kernels").iterdir() if p.is_file()]
    for path in sorted([*(root / "services").rglob("*.py"), *kernels, *(root / "verifier_worker").glob("*.py")]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]

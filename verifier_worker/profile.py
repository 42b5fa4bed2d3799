"""SPS(B): verifier engine steps per second at B batch tokens (docs/design.md §5).

Each point times one forward of B new tokens spread over ceil(B / tokens_per_request) requests,
each with `context` tokens already cached and logits wanted at every new token (a verify step).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from services.layers import RaggedLayout
from services.model import CausalLM
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

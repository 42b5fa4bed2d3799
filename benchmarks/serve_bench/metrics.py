"""Client-side serving metrics, defined exactly as vLLM's `bench serve` (`calculate_metrics`) defines them.

Matching vLLM and SGLang (`bench_serving.py`) keeps our numbers comparable with theirs:
  TTFT    send → first chunk with content (queueing, tokenisation, prefill and the network included);
  E2EL    send → last chunk;
  TPOT    (E2EL − TTFT) / (output_tokens − 1) per request, stats over requests; requests with ≤ 1 token are
          left out of the stats (and count as TPOT 0 for goodput, as in vLLM);
  ITL     every gap between consecutive content chunks, pooled over requests. With speculation several tokens
          share a chunk, so ITL has fewer, larger gaps than TPOT suggests: it measures burstiness;
  per-user tok/s  (output_tokens − 1) / (E2EL − TTFT) = 1 / TPOT per request (DSpark's "TPS");
  request goodput requests meeting *all* given SLOs / duration (vLLM `--goodput`, not DistServe's goodput);
  concurrency     Σ E2EL / duration, SGLang's time-averaged number of requests in flight.
Percentiles are numpy's linear interpolation, as vLLM's `np.percentile`. Failed requests count only in `failed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; the runner builds these, `summarize` reduces a cell of them."""

    arm: str
    prompt_tokens: int
    output_tokens: int
    text: str
    ttft_s: float  # send → first chunk with content
    e2el_s: float  # send → last chunk
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    ok: bool = True
    error: str = ""
    sent_at_s: float = 0.0  # since the cell started


@dataclass(frozen=True, slots=True)
class Slo:
    """Per-request service-level objectives in ms; None leaves that metric unconstrained (vLLM `--goodput`)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def describe(self) -> str:
        """The `--goodput` spelling ("ttft:500 tpot:50"), so a report says which SLOs its goodput used."""
        parts = [(name, getattr(self, f"{name}_ms")) for name in ("ttft", "tpot", "e2el")]
        return " ".join(f"{name}:{value:g}" for name, value in parts if value is not None)


def tpot_s(r: RequestResult) -> float | None:
    """(E2EL − TTFT) / (tokens − 1); None for ≤ 1 token, where no decode interval exists."""
    if r.output_tokens <= 1:
        return None
    return (r.e2el_s - r.ttft_s) / (r.output_tokens - 1)


def per_user_tok_s(r: RequestResult) -> float | None:
    """Decode speed one user sees, 1 / TPOT; None when undefined (≤ 1 token, or every token in the first chunk)."""
    decode_s = r.e2el_s - r.ttft_s
    if r.output_tokens <= 1 or decode_s <= 0:
        return None
    return (r.output_tokens - 1) / decode_s


def meets(r: RequestResult, slo: Slo) -> bool:
    """Whether a request meets every stated SLO; bounds are inclusive and TPOT counts as 0 for ≤ 1 token (vLLM)."""
    checks = ((slo.ttft_ms, r.ttft_s), (slo.tpot_ms, tpot_s(r) or 0.0), (slo.e2el_ms, r.e2el_s))
    return all(limit is None or value * 1000.0 <= limit for limit, value in checks)


def _stats(prefix: str, values: Sequence[float], percentiles: tuple[int, ...], scale: float = 1.0) -> dict:
    """mean/median/std/pXX of a population; None for an empty one rather than vLLM's 0, which reads as a result."""
    keys = ["mean", "median", "std", *(f"p{p}" for p in percentiles)]
    if not values:
        return {f"{prefix}_{k}": None for k in keys}
    a = np.asarray(values, dtype=float) * scale
    out = {f"{prefix}_mean": float(np.mean(a)), f"{prefix}_median": float(np.median(a)),
           f"{prefix}_std": float(np.std(a))}
    out.update({f"{prefix}_p{p}": float(np.percentile(a, p)) for p in percentiles})
    return out


def _rate(count: float, duration_s: float) -> float | None:
    return count / duration_s if duration_s > 0 else None


def _latency_populations(done: list[RequestResult]) -> dict[str, list[float]]:
    """Seconds per metric: TTFT, TPOT and E2EL one value per request, ITL pooled over all requests."""
    tpots = [t for t in map(tpot_s, done) if t is not None]
    return {"ttft": [r.ttft_s for r in done], "tpot": tpots, "itl": [g for r in done for g in r.itl_s],
            "e2el": [r.e2el_s for r in done]}


def _per_user(done: list[RequestResult]) -> dict:
    """Median and p10 (the slowest tenth of users) of per-request decode speed, DSpark's headline latency axis."""
    speeds = [s for s in map(per_user_tok_s, done) if s is not None]
    if not speeds:
        return {"per_user_tok_s_mean": None, "per_user_tok_s_median": None, "per_user_tok_s_p10": None}
    a = np.asarray(speeds, dtype=float)
    return {"per_user_tok_s_mean": float(np.mean(a)), "per_user_tok_s_median": float(np.median(a)),
            "per_user_tok_s_p10": float(np.percentile(a, 10))}


def _goodput(done: list[RequestResult], duration_s: float, slo: Slo | None) -> dict:
    if slo is None:
        return {"goodput_slo": None, "good_requests": None, "request_goodput": None, "goodput_fraction": None}
    good = sum(meets(r, slo) for r in done)
    return {"goodput_slo": slo.describe(), "good_requests": good, "request_goodput": _rate(good, duration_s),
            "goodput_fraction": good / len(done) if done else None}


def summarize(results: list[RequestResult], duration_s: float, slo: Slo | None = None,
              percentiles: tuple[int, ...] = (50, 90, 99)) -> dict:
    """One cell's results as a flat JSON-able dict (latencies in ms, throughputs per second of `duration_s`).

    Rates are None when duration_s ≤ 0 and distribution stats None for an empty population, so an empty or
    all-failed cell summarises without raising and without inventing zeros.
    """
    done = [r for r in results if r.ok]
    inputs = sum(r.prompt_tokens for r in done)
    outputs = sum(r.output_tokens for r in done)
    out = {"completed": len(done), "failed": len(results) - len(done), "duration_s": duration_s,
           "total_input_tokens": inputs, "total_output_tokens": outputs,
           "request_throughput": _rate(len(done), duration_s), "output_throughput": _rate(outputs, duration_s),
           "total_token_throughput": _rate(inputs + outputs, duration_s),
           "concurrency": _rate(sum(r.e2el_s for r in done), duration_s)}
    for name, values in _latency_populations(done).items():
        out.update(_stats(f"{name}_ms", values, percentiles, scale=1000.0))
    out.update(_per_user(done))
    out.update(_goodput(done, duration_s, slo))
    return out

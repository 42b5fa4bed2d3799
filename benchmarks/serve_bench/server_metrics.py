"""Speculative-decoding metrics from the router's Prometheus `/metrics`, diffed over a measurement window.

The router exports counters (router/metrics.py), never per-window gauges, so a cell's numbers are
after − before of two scrapes, as vLLM's and SGLang's benchmarks read theirs: warmup and earlier cells drop
out, and a fresh server per cell is not needed. Notation: N = verify steps with drafts, D = draft tokens sent for
verification, A = accepted draft tokens.
  τ = 1 + A/N (includes the bonus token: the vLLM, DSpark and SGLang convention);  α = A/D;
  per-position acceptance, labelled: unconditional (prefix survival) = accepted_k / N (vLLM `…_per_pos`),
  conditional = accepted_k / accepted_{k−1} with accepted_{−1} = N (DSpark Fig. 2);
  mean verify length ℓ̄ = verified draft tokens per request per step (DSpark Fig. 8), cycles with ℓ = 0 included;
  mean verify budget K̄ = the dspark plan's budget per cycle; wasted fraction = (D − A)/D.
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "dspark:"
_DROPPED_LABELS = frozenset({"model_name"})
_EMPTY_SERIES = {"counter": ("_total",), "histogram": ("_sum", "_count")}


def _key(name: str, labels: dict[str, str]) -> str:
    kept = sorted((k, v) for k, v in labels.items() if k not in _DROPPED_LABELS)
    return name + ("{" + ",".join(f"{k}={v}" for k, v in kept) + "}" if kept else "")


def scrape(text: str) -> dict[str, float]:
    """Flatten an exposition into {"name{label=value,...}": value} for the `dspark:` samples.

    Labels are sorted and model_name dropped so keys do not depend on the served model's name; series that
    then collide (several models on one router) are summed, which is what counters and histograms need.
    `_created` samples are creation timestamps, not counts, and are left out. The router's series are labelled,
    so a counter or histogram never touched yet has no sample at all: it is recorded as an unlabelled 0 so the
    window reads 0 (e.g. no drafts for the `none` arm) while a metric this server does not export stays None.
    """
    flat: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith(PREFIX) and not family.samples:
            for suffix in _EMPTY_SERIES.get(family.type, ()):
                flat.setdefault(family.name + suffix, 0.0)
        for sample in family.samples:
            if not sample.name.startswith(PREFIX) or sample.name.endswith("_created"):
                continue
            key = _key(sample.name, sample.labels)
            flat[key] = flat.get(key, 0.0) + float(sample.value)
    return flat


def _delta(before: dict[str, float], after: dict[str, float], key: str) -> float | None:
    """A counter's increase over the window; None if the series is absent after. A drop means the server
    restarted, and then the after value is the increase (Prometheus `increase()` does the same)."""
    if key not in after:
        return None
    now, then = after[key], before.get(key, 0.0)
    return now if now < then else now - then


def _counter(before: dict, after: dict, name: str) -> float | None:
    return _delta(before, after, f"{PREFIX}{name}_total")


def _histogram_mean(before: dict, after: dict, name: str) -> float | None:
    total = _delta(before, after, f"{PREFIX}{name}_sum")
    count = _delta(before, after, f"{PREFIX}{name}_count")
    return total / count if total is not None and count else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _per_position(before: dict, after: dict) -> list[float]:
    """Accepted tokens at each 0-based draft position over the window, gaps filled with 0."""
    series = f"{PREFIX}spec_decode_num_accepted_tokens_per_pos_total{{position="
    counts: dict[int, float] = {}
    for key in after:
        if key.startswith(series) and key.endswith("}"):
            counts[int(key[len(series):-1])] = _delta(before, after, key) or 0.0
    return [counts.get(k, 0.0) for k in range(max(counts) + 1)] if counts else []


def _conditional(accepted: list[float], drafts: float | None) -> list[float | None]:
    """accepted_k / accepted_{k−1}, the first over N; None where the previous position never survived."""
    prev = [drafts, *accepted][: len(accepted)]
    return [_ratio(a, p) for a, p in zip(accepted, prev, strict=True)]


def _verify_len_hist(before: dict, after: dict) -> dict[str, float]:
    """Cycles per verify length ℓ over the window, empty lengths left out (buckets are the integers 0..16, so
    this is exact)."""
    series = f"{PREFIX}verify_len_bucket{{le="
    cumulative = []
    for key in after:
        if key.startswith(series) and key.endswith("}"):
            cumulative.append((float(key[len(series):-1]), _delta(before, after, key) or 0.0))
    cumulative.sort()
    hist, below = {}, 0.0
    for le, count in cumulative:
        label = "+Inf" if math.isinf(le) else f"{le:g}"
        if count > below:
            hist[label] = count - below
        below = count
    return hist


def spec_decode(before: dict[str, float], after: dict[str, float]) -> dict:
    """The speculation view of one window from two `scrape()`s; None (or []) wherever a series is missing or
    a ratio's denominator is zero (the `none` arm has N = 0, so τ and α are None there, not 1 and 0)."""
    n = _counter(before, after, "spec_decode_num_drafts")
    d = _counter(before, after, "spec_decode_num_draft_tokens")
    a = _counter(before, after, "spec_decode_num_accepted_tokens")
    per_pos = _per_position(before, after)
    hits, misses = _counter(before, after, "spec_cache_hits"), _counter(before, after, "spec_cache_misses")
    return {
        "drafts": n, "draft_tokens": d, "accepted": a,
        "tau": 1.0 + a / n if a is not None and n else None,
        "acceptance_rate": _ratio(a, d),
        "per_position_unconditional": [_ratio(x, n) for x in per_pos] if n else [],
        "per_position_conditional": _conditional(per_pos, n) if n else [],
        "mean_verify_budget": _histogram_mean(before, after, "verify_budget"),
        "mean_verify_len": _histogram_mean(before, after, "verify_len"),
        "verify_cycles": _delta(before, after, f"{PREFIX}verify_len_count"),
        "verify_len_hist": _verify_len_hist(before, after),
        "wasted_verify_fraction": _ratio(d - a, d) if d is not None and a is not None else None,
        "trimmed_draft_tokens": _counter(before, after, "spec_decode_num_trimmed_draft_tokens"),
        "drafts_skipped": _counter(before, after, "scheduler_drafts_skipped"),
        "generation_tokens": _counter(before, after, "generation_tokens"),
        "spec_cache_hits": hits,
        "spec_cache_misses": misses,
        "spec_cache_hit_rate": _ratio(hits, hits + misses) if hits is not None and misses is not None else None,
        "spec_cache_pushed": _counter(before, after, "spec_cache_pushed"),  # hits the router held: no draft request
    }

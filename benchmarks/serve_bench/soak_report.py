"""What a soak run found: memory growth per process, errors by kind, latency drift, leaks; as JSON and tables.

Memory: each process's RSS at the first sample after the warm-up (lazy initialisation, allocator pools and
caches fill during it) and at the last sample under load; growth is their difference and the trend the
least-squares slope over the post-warm-up samples, in MB per minute. Drift: TTFT, TPOT (streamed requests) and
E2EL (every completed request) percentiles of the requests sent in the first window after the warm-up against
those sent in the run's last window; a ratio above 1 means the server got slower.
"""

from __future__ import annotations

import sys
from collections import Counter

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.serve_bench.mixed import ERROR_KINDS, RequestRecord


def analyse(cfg, load_s: float, outcomes: list[RequestRecord], samples: list[dict], labels: dict[int, str],
            leaks: dict) -> dict:
    """`load_s` runs until the last request ended, past `cfg.duration_s` (when the last ones were sent)."""
    warmup_s = warmup(cfg.duration_s)
    processes = [process_row(pid, label, samples, load_s, warmup_s) for pid, label in sorted(labels.items())]
    errors = error_counts(outcomes)
    exited = [f"{p['label']} ({p['pid']})" for p in processes if not p["alive_at_end"]]
    return {"load_s": load_s, "warmup_s": warmup_s, "processes": processes, "errors": errors,
            "requests": request_counts(outcomes),
            "drift": drift(outcomes, cfg.duration_s, warmup_s, cfg.window_fraction), "leaks": leaks, "exited": exited,
            "samples": [{"t": round(s["t"], 2), "router": s["router"], "tiers": s["tiers"]} for s in samples],
            "passed": not errors["total"] and not leaks and not exited}


def warmup(duration_s: float) -> float:
    """The first 10 % of the run, but at least 30 s (a quarter of a run shorter than 2 min)."""
    return max(0.1 * duration_s, min(30.0, 0.25 * duration_s))


def process_row(pid: int, label: str, samples: list[dict], load_s: float, warmup_s: float) -> dict:
    """One process's RSS over the load phase (the drain's samples only tell whether it is still alive)."""
    series = [(s["t"], s["rss_mb"][pid]) for s in samples if s["t"] <= load_s and pid in s["rss_mb"]]
    since = next((t for t, _ in series), None)
    expected = sum(s["t"] <= load_s and since is not None and s["t"] >= since for s in samples)
    steady = [(t, mb) for t, mb in series if t >= warmup_s] or series
    start, end = (steady[0][1], steady[-1][1]) if steady else (None, None)
    return {"pid": pid, "label": label, "samples": len(series), "expected_samples": expected,
            "start_mb": start, "end_mb": end, "growth_mb": None if start is None else end - start,
            "mb_per_min": slope_per_min(steady), "peak_mb": max((mb for _, mb in series), default=None),
            "alive_at_end": bool(samples) and pid in samples[-1]["rss_mb"],
            "series": [[round(t, 1), round(mb, 1)] for t, mb in series]}


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) points in MB/min; None for fewer than two distinct times."""
    if len({t for t, _ in points}) < 2:
        return None
    t, mb = np.array(points).T
    return float(np.polyfit(t, mb, 1)[0] * 60.0)


def error_counts(outcomes: list[RequestRecord]) -> dict:
    """Requests the server got wrong, by kind, with a few examples of each."""
    kinds = Counter(o.error for o in outcomes if o.error)
    examples = {k: [f"{describe(o)}: {o.detail}" for o in outcomes if o.error == k][:3] for k in kinds}
    return {"total": sum(kinds.values()), **{k: kinds.get(k, 0) for k in ERROR_KINDS}, "examples": examples}


def describe(o: RequestRecord) -> str:
    s = o.shape
    if s.kind == "bad":
        return f"bad request {s.bad} at {o.sent_at_s:.1f} s"
    return (f"{s.kind}{' streamed' if s.stream else ''} {s.arm} T={s.temperature:g} max_tokens={s.max_tokens}"
            f"{' ignore_eos' if s.ignore_eos else ''} at {o.sent_at_s:.1f} s")


def request_counts(outcomes: list[RequestRecord]) -> dict:
    shapes = [o.shape for o in outcomes]
    return {"sent": len(outcomes), "completed": sum(o.completed for o in outcomes),
            "completion": sum(s.kind == "completion" for s in shapes), "chat": sum(s.kind == "chat" for s in shapes),
            "streamed": sum(s.stream for s in shapes), "sampled": sum(s.temperature > 0 for s in shapes),
            "disconnected": sum(o.disconnected for o in outcomes),
            "bad_refused": sum(s.kind == "bad" and not o.error for s, o in zip(shapes, outcomes, strict=True)),
            "output_tokens": sum(o.output_tokens for o in outcomes if o.completed),
            "by_arm": dict(Counter(s.arm for s in shapes if s.kind != "bad"))}


def latencies(outcomes: list[RequestRecord]) -> dict[str, list[float]]:
    """Seconds per metric over completed requests: E2EL for all, TTFT and TPOT for streamed ones."""
    done = [o for o in outcomes if o.completed]
    streamed = [o for o in done if o.shape.stream and o.ttft_s is not None]
    return {"ttft": [o.ttft_s for o in streamed], "e2el": [o.e2el_s for o in done],
            "tpot": [(o.e2el_s - o.ttft_s) / (o.output_tokens - 1) for o in streamed if o.output_tokens > 1]}


def drift(outcomes: list[RequestRecord], duration_s: float, warmup_s: float, window_fraction: float) -> dict:
    """p50 / p90 in ms of the requests sent in the first and in the last window, and last / first."""
    width = window_fraction * duration_s
    first = latencies([o for o in outcomes if warmup_s <= o.sent_at_s < warmup_s + width])
    last = latencies([o for o in outcomes if o.sent_at_s >= duration_s - width])
    out = {"window_s": width}
    for metric in ("ttft", "tpot", "e2el"):
        row = {"first_n": len(first[metric]), "last_n": len(last[metric])}
        for p in (50, 90):
            a, b = (float(np.percentile(x, p)) * 1000 if x else None for x in (first[metric], last[metric]))
            row |= {f"first_p{p}_ms": a, f"last_p{p}_ms": b, f"ratio_p{p}": b / a if a and b is not None else None}
        out[metric] = row
    return out


def _f(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def print_report(results: dict) -> None:
    console = Console(width=None if sys.stdout.isatty() else 130)  # rich assumes 80 columns in a pipe or log
    table = Table(title=f"soak: RSS per process ({results['load_s']:.0f} s of load, baseline after "
                        f"{results['warmup_s']:.0f} s)")
    for col in ("process", "pid", "samples", "start MB", "end MB", "growth MB", "MB/min", "peak MB"):
        table.add_column(col, justify="left" if col == "process" else "right")
    for p in results["processes"]:
        table.add_row(p["label"] + ("" if p["alive_at_end"] else " [red](exited)[/red]"), str(p["pid"]),
                      f"{p['samples']}/{p['expected_samples']}", _f(p["start_mb"]), _f(p["end_mb"]),
                      _f(p["growth_mb"]), _f(p["mb_per_min"], 2), _f(p["peak_mb"]))
    console.print(table)
    drifts = Table(title=f"soak: latency drift (first vs last {results['drift']['window_s']:.0f} s window)")
    for col in ("metric", "n first/last", "p50 first", "p50 last", "ratio", "p90 first", "p90 last", "ratio"):
        drifts.add_column(col, justify="right")
    for metric in ("ttft", "tpot", "e2el"):
        d = results["drift"][metric]
        drifts.add_row(metric, f"{d['first_n']}/{d['last_n']}", _f(d["first_p50_ms"]), _f(d["last_p50_ms"]),
                       _f(d["ratio_p50"], 2), _f(d["first_p90_ms"]), _f(d["last_p90_ms"]), _f(d["ratio_p90"], 2))
    console.print(drifts)
    r, e = results["requests"], results["errors"]
    console.print(f"requests: {r['sent']} sent, {r['completed']} completed ({r['output_tokens']} tokens), "
                  f"{r['streamed']} streamed, {r['sampled']} sampled, {r['disconnected']} hung up, "
                  f"{r['bad_refused']} bad ones refused; by arm {r['by_arm']}")
    console.print(f"errors: {e['total']} " + ", ".join(f"{k} {e[k]}" for k in ERROR_KINDS)
                  + "".join(f"\n  {k}: {x}" for k, xs in e["examples"].items() for x in xs))
    console.print(f"after the load: {'nothing left in flight' if not results['leaks'] else results['leaks']}"
                  + (f"; exited: {', '.join(results['exited'])}" if results["exited"] else ""))
    console.print("[green]PASSED[/green]" if results["passed"] else "[red]FAILED[/red]")

"""`dspark simulate`'s outputs: simulate.json, PNG plots (Figure + FigureCanvasAgg, no pyplot) and simulate.md."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from benchmarks.serve_bench.cells import color
from benchmarks.simulator.studies import VALIDATED, ScaleRow, ValidationRow

LABELS = {"output_throughput": "output tok/s", "per_user_tok_s_median": "per-user tok/s (median)"}


def validation_json(rows: list[ValidationRow]) -> list[dict]:
    return [{"arm": r.arm, "concurrency": r.concurrency, "measured": r.measured, "simulated": r.simulated,
             "error": {k: r.error(k) for k in VALIDATED}} for r in rows]


def rows_json(rows: list[ScaleRow]) -> list[dict]:
    return [dataclasses.asdict(r) for r in rows]


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return path


def plot_validation(rows: list[ValidationRow], path: Path) -> Path:
    """Measured (solid, dots) vs simulated (dashed, crosses) per arm against concurrency, one panel per metric."""
    fig = Figure(figsize=(11, 4.2))
    arms = list(dict.fromkeys(r.arm for r in rows))
    for i, key in enumerate(VALIDATED):
        ax = fig.add_subplot(1, 2, i + 1)
        for arm in arms:
            mine = sorted((r for r in rows if r.arm == arm), key=lambda r: r.concurrency)
            cs = [r.concurrency for r in mine]
            ax.plot(cs, [r.measured[key] for r in mine], "o-", color=color(arm), label=f"{arm} measured")
            ax.plot(cs, [r.simulated[key] for r in mine], "x--", color=color(arm), label=f"{arm} simulated")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(LABELS[key])
        ax.grid(alpha=0.3)
    fig.axes[0].legend(fontsize=6, ncol=2)
    fig.suptitle("simulator validation: N = M = 1, this machine's calibration")
    fig.tight_layout()
    return _save(fig, path)


def plot_scale(rows: list[ScaleRow], path: Path) -> Path:
    metrics = (("throughput_per_gpu", "output tok/s per GPU (verifier + drafter share)"),
               ("per_user_tok_s", "per-user tok/s (median)"))
    return _panels(rows, metrics, lambda r: r.verifiers, {"value": "log"}, "verifier GPUs N (32 users each)",
                   "scale-out on the illustrative GPU profile", path)


def plot_ratio(rows: list[ScaleRow], path: Path) -> Path:
    metrics = (("throughput", "output tok/s"), ("throughput_per_gpu", "output tok/s per GPU"))
    return _panels(rows, metrics, lambda r: r.drafters / r.verifiers, {"value": "log", "base": 2},
                   "drafter : verifier replicas (M/N)", "drafter : verifier ratio", path)


def _panels(rows: list[ScaleRow], metrics, x, xscale: dict, xlabel: str, title: str, path: Path) -> Path:
    """One panel per (row attribute, label), one line per arm against x(row) on a log axis."""
    fig = Figure(figsize=(11, 4.2))
    for i, (key, label) in enumerate(metrics):
        ax = fig.add_subplot(1, 2, i + 1)
        for arm in dict.fromkeys(r.arm for r in rows):
            mine = sorted((r for r in rows if r.arm == arm), key=x)
            ax.plot([x(r) for r in mine], [getattr(r, key) for r in mine], "o-", color=color(arm), label=arm)
        ax.set_xscale(**xscale)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def _pct(x: float) -> str:
    return f"{100 * x:+.0f} %" if math.isfinite(x) else "—"


def validation_md(rows: list[ValidationRow], fitted: dict) -> list[str]:
    lines = ["## Validation (N = M = 1, simulated vs measured)", "",
             f"Global constants: drafter per-request slope {fitted.get('slope')}, contention {fitted.get('contention')}"
             f" (fit: {fitted.get('fit')}). Mean |log error| {fitted.get('score', math.nan):.3f}.", "",
             "| arm | c | tok/s meas | tok/s sim | err | per-user meas | per-user sim | err | TTFT ms meas/sim "
             "| τ meas/sim | ℓ̄ meas/sim |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, s = r.measured, r.simulated
        lines.append(f"| {r.arm} | {r.concurrency} | {m['output_throughput']:.1f} | {s['output_throughput']:.1f} | "
                     f"{_pct(r.error('output_throughput'))} | {m['per_user_tok_s_median']:.1f} | "
                     f"{s['per_user_tok_s_median']:.1f} | {_pct(r.error('per_user_tok_s_median'))} | "
                     f"{m['ttft_ms_mean']:.0f} / {s['ttft_ms_mean']:.0f} | {m['tau']:.2f} / {s['tau']:.2f} | "
                     f"{m['mean_verify_len']:.2f} / {s['mean_verify_len']:.2f} |")
    errs = [abs(r.error(k)) for r in rows for k in VALIDATED if math.isfinite(r.error(k))]
    within = sum(e <= 0.15 for e in errs)
    lines += ["", f"{within} of {len(errs)} (cell, metric) pairs within 15 %; worst {_pct(max(errs, default=0))}."]
    return lines


def scale_md(rows: list[ScaleRow], title: str) -> list[str]:
    lines = [f"## {title}", "", "| policy | N | M | GPUs | users | tok/s | tok/s/GPU | per-user tok/s | τ | ℓ̄ | K̄* "
             "| shards | wall s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.arm} | {r.verifiers} | {r.drafters} | {r.gpus:g} | {r.clients} | {r.throughput:.0f} | "
                     f"{r.throughput_per_gpu:.1f} | {r.per_user_tok_s:.1f} | {r.tau:.2f} | {r.mean_verify_len:.2f} | "
                     f"{r.mean_budget:.1f} | {r.shards} | {r.wall_s:.1f} |")
    return lines


def markdown(doc: dict, images: list[Path]) -> str:
    out = ["# dspark simulate", "", doc.get("about", ""), ""]
    if "calibration" in doc:
        cal = doc["calibration"]
        out += ["## Calibration", "", f"hop {cal['hop_s'] * 1e3:.2f} ms one way, router {cal['router_s'] * 1e3:.2f} ms "
                f"per cycle, prefill correction {cal['prefill_extra_s'] * 1e3:+.1f} ms, drafter step at batch 1: "
                + ", ".join(f"{m} {s * 1e3:.1f} ms" for m, s in cal["draft_s"].items()), ""]
    if "validation" in doc:
        rows = [ValidationRow(r["arm"], r["concurrency"], r["measured"], r["simulated"]) for r in doc["validation"]]
        out += [*validation_md(rows, doc.get("globals", {})), ""]
    if "scale" in doc:
        out += [*scale_md([ScaleRow(**r) for r in doc["scale"]], "Scale-out (illustrative GPU profile)"), ""]
    if "ratio" in doc:
        out += [*scale_md([ScaleRow(**r) for r in doc["ratio"]], "Drafter : verifier ratio"), ""]
        rec = doc.get("recommendation") or {}
        if rec:
            out += [f"**Recommendation**: M/N = {rec['ratio']:g} for {rec['arm']} (smallest ratio within 5 % of the "
                    f"best throughput, {rec['throughput']:.0f} vs {rec['best_throughput']:.0f} tok/s); per GPU the "
                    f"best ratio is {rec['best_per_gpu_ratio']:g} ({rec['best_per_gpu']:.1f} tok/s/GPU).", ""]
    out += [f"![{p.stem}]({p.name})" for p in images]
    return "\n".join(out) + "\n"

"""Plots and a markdown report of one serving-benchmark run, shaped like DSpark's serving figures.

Input is the run's results dict (what the runner saves as JSON):

    {"metadata": {"date", "machine", "model", "dataset", "max_tokens", "temperature", "git", ...; optional "gpus"},
     "cells": [{"arm": "none" | "mtp1" | "eagle3" | "dflash" | "dspark-fixed" | "dspark",
                "load": {"mode": "closed", "concurrency": int} | {"mode": "open", "rate": float},
                "summary": metrics.summarize(...), "server": server_metrics.spec_decode(...); optional "gpus"}],
     "gates": {"greedy_identical": {arm: bool}, "distribution": {arm: {"p_value": float, "passed": bool}}, ...}}

The headline comparison is per-user speed at *matched throughput*: a faster arm that only wins by serving
less is no win, so the other arm's per-user speed is interpolated at dspark's throughput on its own Pareto
curve. When every cell says how many GPUs (drafter and verifier) it used, throughput is per GPU, as DSpark
reports it; otherwise it is the raw output tok/s.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable
from functools import partial
from itertools import pairwise
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

ARM_ORDER = ("none", "mtp1", "eagle3", "dflash", "dspark-fixed", "dspark")
HEADLINE_ARM = "dspark"
COMPARED_ARMS = ("none", "mtp1")
_METADATA_ORDER = ("date", "machine", "model", "dataset", "max_tokens", "temperature", "git")


# --- cells -------------------------------------------------------------------------------------------------------

def _mode(cell: dict) -> str:
    return cell.get("load", {}).get("mode", "closed")


def _load(cell: dict) -> float:
    """The load axis: max concurrency for closed-loop cells, request rate for open-loop ones."""
    load = cell.get("load", {})
    value = load.get("concurrency") if _mode(cell) == "closed" else load.get("rate")
    return float(value) if value is not None else math.nan


def _arm_rank(arm: str) -> tuple[int, str]:
    return (ARM_ORDER.index(arm) if arm in ARM_ORDER else len(ARM_ORDER), arm)


def _color(arm: str) -> str:
    """One colour per arm in every plot, so a reader can follow an arm from figure to figure."""
    return f"C{_arm_rank(arm)[0] % 10}"


def _by_arm(cells: Iterable[dict], mode: str) -> dict[str, list[dict]]:
    """Cells of one load mode per arm, arms in the canonical order and each arm's cells by increasing load."""
    arms: dict[str, list[dict]] = {}
    for cell in cells:
        if _mode(cell) == mode:
            arms.setdefault(cell["arm"], []).append(cell)
    return {arm: sorted(arms[arm], key=_load) for arm in sorted(arms, key=_arm_rank)}


def _summary(cell: dict, key: str) -> float | None:
    return (cell.get("summary") or {}).get(key)


def _server(cell: dict, key: str):
    return (cell.get("server") or {}).get(key)


def _gpus(cell: dict, metadata: dict) -> float | None:
    return cell.get("gpus") or metadata.get("gpus")


def _per_gpu(results: dict) -> bool:
    """Normalise throughput per GPU only when every cell can be, so arms are never mixed across units."""
    cells, metadata = results.get("cells", []), results.get("metadata", {})
    return bool(cells) and all(_gpus(c, metadata) for c in cells)


def _throughput(cell: dict, results: dict) -> float | None:
    tput = _summary(cell, "output_throughput")
    if tput is None or not _per_gpu(results):
        return tput
    return tput / _gpus(cell, results.get("metadata", {}))


def _throughput_label(results: dict) -> str:
    return "output tok/s/GPU" if _per_gpu(results) else "output tok/s"


def _load_label(cell: dict) -> str:
    value = _load(cell)
    return f"{value:g}" if not math.isnan(value) else "?"


# --- matched-throughput comparison -----------------------------------------------------------------------------

def interpolate_speed(curve: list[tuple[float, float]], throughput: float) -> float | None:
    """Per-user speed of a Pareto curve [(throughput, speed)] (in load order) at `throughput`; None when no point
    or segment brackets it. Past saturation throughput can fall again, so several segments may bracket it: the
    fastest is taken, which favours the baseline."""
    found = [s for t, s in curve if t == throughput]
    for (t0, s0), (t1, s1) in pairwise(curve):
        if min(t0, t1) <= throughput <= max(t0, t1) and t0 != t1:
            found.append(s0 + (throughput - t0) * (s1 - s0) / (t1 - t0))
    return max(found) if found else None


def _curve(cells: list[dict], results: dict) -> list[tuple[float, float]]:
    points = [(_throughput(c, results), _summary(c, "per_user_tok_s_median")) for c in cells]
    return [(t, s) for t, s in points if t is not None and s is not None]


def matched_ratios(results: dict, other: str) -> list[dict]:
    """For each closed-loop dspark cell: dspark's per-user speed over `other`'s at the same throughput."""
    arms = _by_arm(results.get("cells", []), "closed")
    curve = _curve(arms.get(other, []), results)
    rows = []
    for cell in arms.get(HEADLINE_ARM, []):
        tput, speed = _throughput(cell, results), _summary(cell, "per_user_tok_s_median")
        base = interpolate_speed(curve, tput) if tput is not None and speed is not None else None
        rows.append({"concurrency": _load(cell), "throughput": tput, "speed": speed, "other_speed": base,
                     "ratio": speed / base if base else None})
    return rows


# --- plots -----------------------------------------------------------------------------------------------------

def _figure(ncols: int = 1) -> tuple[Figure, list]:
    """A pyplot-free figure on the Agg canvas: no display needed and no global figure state to leak."""
    fig = Figure(figsize=(6.0 * ncols, 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=120)
    return path


def _plot_pareto(results: dict, path: Path) -> Path | None:
    arms = _by_arm(results.get("cells", []), "closed")
    fig, (ax,) = _figure()
    drawn = False
    for arm, cells in arms.items():
        points = [(_summary(c, "per_user_tok_s_median"), _throughput(c, results), _load_label(c)) for c in cells]
        points = [p for p in points if p[0] is not None and p[1] is not None]
        if not points:
            continue
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=_color(arm), label=arm)
        for x, y, c in points:
            ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        drawn = True
    if not drawn:
        return None
    ax.set(xlabel="per-user tok/s (median)", ylabel=_throughput_label(results),
           title="Throughput vs per-user speed (closed loop)")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _series(cells: list[dict], value: Callable[[dict], float | None]) -> tuple[list[float], list[float]]:
    points = [(_load(c), value(c)) for c in cells]
    points = [(x, y) for x, y in points if y is not None and not math.isnan(x)]
    return [x for x, _ in points], [y for _, y in points]


def _plot_verify_budget(results: dict, path: Path) -> Path | None:
    arms = {a: c for a, c in _by_arm(results.get("cells", []), "closed").items() if a != "none"}
    panels = [("mean_verify_len", "verified draft tokens per request per step (ℓ̄)"),
              ("mean_verify_budget", "verify budget of the dspark plan (K̄)")]
    panels = [p for p in panels if any(_series(cells, lambda c, k=p[0]: _server(c, k))[0] for cells in arms.values())]
    if not panels:
        return None
    fig, axes = _figure(len(panels))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for arm, cells in arms.items():
            xs, ys = _series(cells, lambda c, k=key: _server(c, k))
            if xs:
                ax.plot(xs, ys, marker="o", color=_color(arm), label=arm)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="max concurrency", ylabel=label, title=label.split(" (")[0])
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, path)


def _lowest_load_cells(results: dict) -> dict[str, dict]:
    """Each speculative arm's lowest-load cell with per-position data, closed loop first (least batching noise)."""
    chosen: dict[str, dict] = {}
    for mode in ("closed", "open"):
        for arm, cells in _by_arm(results.get("cells", []), mode).items():
            with_data = [c for c in cells if _server(c, "per_position_unconditional")]
            if arm not in chosen and with_data:
                chosen[arm] = with_data[0]
    return chosen


def _plot_acceptance(results: dict, path: Path) -> Path | None:
    chosen = _lowest_load_cells(results)
    if not chosen:
        return None
    fig, axes = _figure(2)
    panels = [("per_position_unconditional", "unconditional (prefix survival): accepted_k / N"),
              ("per_position_conditional", "conditional: accepted_k / accepted_k−1")]
    for ax, (key, title) in zip(axes, panels, strict=True):
        for arm, cell in chosen.items():
            values = _server(cell, key) or []
            points = [(k + 1, v) for k, v in enumerate(values) if v is not None]
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=_color(arm),
                        label=f"{arm} ({cell['load'].get('mode')} {_load_label(cell)})")
        ax.set(xlabel="draft position (1 = first)", ylabel="acceptance", title=title, ylim=(0, 1.05))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def _plot_open_loop(results: dict, path: Path) -> Path | None:
    arms = _by_arm(results.get("cells", []), "open")
    if not arms:
        return None
    panels = [(lambda c: _throughput(c, results), _throughput_label(results))]
    if any(_series(cells, lambda c: _summary(c, "request_goodput"))[0] for cells in arms.values()):
        panels.append((lambda c: _summary(c, "request_goodput"), "request goodput (req/s meeting all SLOs)"))
    fig, axes = _figure(len(panels))
    for ax, (value, label) in zip(axes, panels, strict=True):
        for arm, cells in arms.items():
            xs, ys = _series(cells, value)
            if xs:
                ax.plot(xs, ys, marker="o", color=_color(arm), label=arm)
        ax.set(xlabel="request rate (req/s)", ylabel=label, title=f"{label.split(' (')[0]} vs request rate")
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, path)


def plots(results: dict, out_dir: Path) -> list[Path]:
    """Write pareto.png, verify_budget.png, acceptance.png and (with open-loop cells) open_loop.png into out_dir;
    a plot with nothing to draw is skipped, so the returned list names only files that exist."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    makers = [(_plot_pareto, "pareto.png"), (_plot_verify_budget, "verify_budget.png"),
              (_plot_acceptance, "acceptance.png"), (_plot_open_loop, "open_loop.png")]
    written = [make(results, out_dir / name) for make, name in makers]
    return [p for p in written if p is not None]


# --- markdown --------------------------------------------------------------------------------------------------

def _fmt(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:,.{digits}f}"


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _metadata_line(metadata: dict) -> str:
    keys = [k for k in _METADATA_ORDER if k in metadata] + [k for k in metadata if k not in _METADATA_ORDER]
    parts = []
    for k in keys:
        v = metadata[k]
        parts.append(f"{k}: {json.dumps(v, separators=(',', ':')) if isinstance(v, dict | list) else v}")
    return " · ".join(parts)


def _cell_row(cell: dict, results: dict) -> list[str]:
    s = partial(_summary, cell)
    row = [cell["arm"], _load_label(cell), _fmt(s("per_user_tok_s_median")), _fmt(s("per_user_tok_s_p10")),
           _fmt(s("output_throughput"))]
    if _per_gpu(results):
        row.append(_fmt(_throughput(cell, results)))
    row += [_fmt(s("ttft_ms_p50")), _fmt(s("ttft_ms_p99")), _fmt(s("tpot_ms_p50"), 2), _fmt(s("tpot_ms_p99"), 2),
            _fmt(s("itl_ms_p99")), _fmt(s("e2el_ms_p99")), _fmt(_server(cell, "tau"), 2),
            _pct(_server(cell, "acceptance_rate")), _fmt(_server(cell, "mean_verify_len"), 2),
            _fmt(_server(cell, "mean_verify_budget"), 1), _pct(_server(cell, "wasted_verify_fraction")),
            str(s("failed") if s("failed") is not None else "–")]
    if _mode(cell) == "open":
        row += [_fmt(s("request_goodput"), 2), _pct(s("goodput_fraction"))]
    return row


def _cells_section(results: dict, mode: str) -> list[str]:
    arms = _by_arm(results.get("cells", []), mode)
    if not arms:
        return []
    title = "Closed loop (max concurrency c)" if mode == "closed" else "Open loop (Poisson request rate)"
    header = ["arm", "c" if mode == "closed" else "rate", "user tok/s p50", "user tok/s p10", "output tok/s"]
    if _per_gpu(results):
        header.append("tok/s/GPU")
    header += ["TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "ITL p99 ms", "E2EL p99 ms", "τ", "α",
               "ℓ̄/req", "budget K̄", "wasted", "failed"]
    if mode == "open":
        header += ["goodput req/s", "good %"]
    rows = [_cell_row(cell, results) for cells in arms.values() for cell in cells]
    return [f"## {title}", "", *_table(header, rows), ""]


def _ratio_section(results: dict) -> list[str]:
    lines = ["## DSpark per-user speed at matched throughput", "",
             f"Ratio = {HEADLINE_ARM}'s median per-user tok/s over the other arm's, interpolated at {HEADLINE_ARM}'s "
             f"{_throughput_label(results)} on the other arm's closed-loop Pareto curve.", ""]
    closed = _by_arm(results.get("cells", []), "closed")
    if HEADLINE_ARM not in closed:
        return [*lines, f"No closed-loop `{HEADLINE_ARM}` cells.", ""]
    for other in COMPARED_ARMS:
        lines.append(f"### {HEADLINE_ARM} / {other}")
        lines.append("")
        if other not in closed:
            lines += [f"Arm `{other}` was not run.", ""]
            continue
        rows = [[_fmt(r["concurrency"], 0), _fmt(r["throughput"]), _fmt(r["speed"]),
                 _fmt(r["other_speed"]) if r["other_speed"] is not None else "outside range",
                 f"{r['ratio']:.2f}×" if r["ratio"] is not None else "outside range"]
                for r in matched_ratios(results, other)]
        header = ["c", _throughput_label(results), f"{HEADLINE_ARM} user tok/s", f"{other} user tok/s", "ratio"]
        lines += [*_table(header, rows), ""]
    return lines


def _gate_verdict(value) -> tuple[str, str]:
    """(PASS/FAIL/–, details) of one arm's gate entry: a bool, or a dict with `passed` and any other fields."""
    if isinstance(value, bool):
        return ("PASS" if value else "FAIL"), ""
    if isinstance(value, dict):
        passed = value.get("passed")
        details = ", ".join(f"{k}={_detail(v)}" for k, v in value.items() if k != "passed")
        return ("–" if passed is None else "PASS" if passed else "FAIL"), details
    return "–", str(value)


def _detail(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _gates_section(gates: dict) -> list[str]:
    if not gates:
        return ["## Gates", "", "No gates were run.", ""]
    rows = []
    for gate, entries in gates.items():
        items = entries.items() if isinstance(entries, dict) and not {"passed"} & entries.keys() else [("–", entries)]
        rows += [[gate, arm, *_gate_verdict(value)] for arm, value in items]
    failed = sum(r[2] == "FAIL" for r in rows)
    verdict = "All gates pass." if not failed else f"**{failed} gate result(s) FAIL.**"
    return ["## Gates", "", verdict, "", *_table(["gate", "arm", "result", "details"], rows), ""]


def _image_ref(path: Path, base: Path | None) -> str:
    """Relative to `base` when given; otherwise the bare file name, for a report written next to its plots."""
    path = Path(path)
    if base is not None:
        return Path(os.path.relpath(path, base)).as_posix()
    return path.name if path.is_absolute() else path.as_posix()


def markdown(results: dict, images: list[Path] | None = None, base: Path | None = None) -> str:
    """The run as markdown: metadata, one table per load mode, matched-throughput ratios, gates and plots.

    Image links are relative: to `base` (the directory the markdown will be written to) when given, otherwise
    just the file name, which is right when the report is saved in the plots' directory.
    """
    lines = ["# Serving benchmark", "", _metadata_line(results.get("metadata", {})), ""]
    for mode in ("closed", "open"):
        lines += _cells_section(results, mode)
    lines += _ratio_section(results)
    lines += _gates_section(results.get("gates", {}))
    if images:
        lines += ["## Plots", "", *(f"![{Path(p).stem}]({_image_ref(p, base)})" for p in images), ""]
    return "\n".join(lines)

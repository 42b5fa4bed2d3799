"""The Markdown summary of one serving-benchmark run: tables per load mode, per-user speed at matched
throughput against none and mtp1, the losslessness gates, the plots."""

from __future__ import annotations

import json
import math
import os
from functools import partial
from pathlib import Path

from benchmarks.serve_bench.cells import (
    COMPARED_ARMS,
    HEADLINE_ARM,
    by_arm,
    cell_mode,
    load_label,
    matched_ratios,
    per_gpu,
    server,
    summary,
    throughput,
    throughput_label,
)

# --- markdown --------------------------------------------------------------------------------------------------

def _fmt(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:,.{digits}f}"

_METADATA_ORDER = ("date", "machine", "model", "dataset", "max_tokens", "temperature", "git")


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
    s = partial(summary, cell)
    row = [cell["arm"], load_label(cell), _fmt(s("per_user_tok_s_median")), _fmt(s("per_user_tok_s_p10")),
           _fmt(s("output_throughput"))]
    if per_gpu(results):
        row.append(_fmt(throughput(cell, results)))
    row += [_fmt(s("ttft_ms_p50")), _fmt(s("ttft_ms_p99")), _fmt(s("tpot_ms_p50"), 2), _fmt(s("tpot_ms_p99"), 2),
            _fmt(s("itl_ms_p99")), _fmt(s("e2el_ms_p99")), _fmt(server(cell, "tau"), 2),
            _pct(server(cell, "acceptance_rate")), _fmt(server(cell, "mean_verify_len"), 2),
            _fmt(server(cell, "mean_verify_budget"), 1), _pct(server(cell, "wasted_verify_fraction")),
            str(s("failed") if s("failed") is not None else "–")]
    if cell_mode(cell) == "open":
        row += [_fmt(s("request_goodput"), 2), _pct(s("goodput_fraction"))]
    return row


def _cells_section(results: dict, mode: str) -> list[str]:
    arms = by_arm(results.get("cells", []), mode)
    if not arms:
        return []
    title = "Closed loop (max concurrency c)" if mode == "closed" else "Open loop (Poisson request rate)"
    header = ["arm", "c" if mode == "closed" else "rate", "user tok/s p50", "user tok/s p10", "output tok/s"]
    if per_gpu(results):
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
             f"{throughput_label(results)} on the other arm's closed-loop Pareto curve.", ""]
    closed = by_arm(results.get("cells", []), "closed")
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
        header = ["c", throughput_label(results), f"{HEADLINE_ARM} user tok/s", f"{other} user tok/s", "ratio"]
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

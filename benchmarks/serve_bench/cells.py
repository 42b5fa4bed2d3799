"""The results of one serving-benchmark run, as the plots and the report read them.

Input is the run's results dict (what the runner saves as JSON):

    {"metadata": {"date", "machine", "model", "dataset", "max_tokens", "temperature", "git", ...; optional "gpus"},
     "cells": [{"arm": "none" | "mtp1" | "eagle3" | "dflash" | "dspark-fixed" | "dspark" | "dspark-ahead",
                "load": {"mode": "closed", "concurrency": int} | {"mode": "open", "rate": float},
                "summary": metrics.summarize(...), "server": server_metrics.spec_decode(...); optional "gpus"}],
     "gates": {"greedy_identical": {arm: bool}, "distribution": {arm: {"p_value": float, "passed": bool}}, ...}}

The headline comparison is per-user speed at *matched throughput*: a faster arm that only wins by serving
less is no win, so the other arm's per-user speed is interpolated at dspark's throughput on its own Pareto
curve. When every cell says how many GPUs (drafter and verifier) it used, throughput is per GPU, as DSpark
reports it; otherwise it is the raw output tok/s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from itertools import pairwise

ARM_ORDER = ("none", "mtp1", "eagle3", "dflash", "dspark-fixed", "dspark", "dspark-ahead")
HEADLINE_ARM = "dspark"
COMPARED_ARMS = ("none", "mtp1")


# --- cells -------------------------------------------------------------------------------------------------------

def cell_mode(cell: dict) -> str:
    return cell.get("load", {}).get("mode", "closed")


def cell_load(cell: dict) -> float:
    """The load axis: max concurrency for closed-loop cells, request rate for open-loop ones."""
    load = cell.get("load", {})
    value = load.get("concurrency") if cell_mode(cell) == "closed" else load.get("rate")
    return float(value) if value is not None else math.nan


def arm_rank(arm: str) -> tuple[int, str]:
    return (ARM_ORDER.index(arm) if arm in ARM_ORDER else len(ARM_ORDER), arm)


def color(arm: str) -> str:
    """One colour per arm in every plot, so a reader can follow an arm from figure to figure."""
    return f"C{arm_rank(arm)[0] % 10}"


def by_arm(cells: Iterable[dict], mode: str) -> dict[str, list[dict]]:
    """Cells of one load mode per arm, arms in the canonical order and each arm's cells by increasing load."""
    arms: dict[str, list[dict]] = {}
    for cell in cells:
        if cell_mode(cell) == mode:
            arms.setdefault(cell["arm"], []).append(cell)
    return {arm: sorted(arms[arm], key=cell_load) for arm in sorted(arms, key=arm_rank)}


def summary(cell: dict, key: str) -> float | None:
    return (cell.get("summary") or {}).get(key)


def server(cell: dict, key: str):
    return (cell.get("server") or {}).get(key)


def gpus(cell: dict, metadata: dict) -> float | None:
    return cell.get("gpus") or metadata.get("gpus")


def per_gpu(results: dict) -> bool:
    """Normalise throughput per GPU only when every cell can be, so arms are never mixed across units."""
    cells, metadata = results.get("cells", []), results.get("metadata", {})
    return bool(cells) and all(gpus(c, metadata) for c in cells)


def throughput(cell: dict, results: dict) -> float | None:
    tput = summary(cell, "output_throughput")
    if tput is None or not per_gpu(results):
        return tput
    return tput / gpus(cell, results.get("metadata", {}))


def throughput_label(results: dict) -> str:
    return "output tok/s/GPU" if per_gpu(results) else "output tok/s"


def load_label(cell: dict) -> str:
    value = cell_load(cell)
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


def pareto_curve(cells: list[dict], results: dict) -> list[tuple[float, float]]:
    points = [(throughput(c, results), summary(c, "per_user_tok_s_median")) for c in cells]
    return [(t, s) for t, s in points if t is not None and s is not None]


def matched_ratios(results: dict, other: str) -> list[dict]:
    """For each closed-loop dspark cell: dspark's per-user speed over `other`'s at the same throughput."""
    arms = by_arm(results.get("cells", []), "closed")
    curve = pareto_curve(arms.get(other, []), results)
    rows = []
    for cell in arms.get(HEADLINE_ARM, []):
        tput, speed = throughput(cell, results), summary(cell, "per_user_tok_s_median")
        base = interpolate_speed(curve, tput) if tput is not None and speed is not None else None
        rows.append({"concurrency": cell_load(cell), "throughput": tput, "speed": speed, "other_speed": base,
                     "ratio": speed / base if base else None})
    return rows

"""PNG figures of one serving-benchmark run: throughput against per-user speed (Pareto), verify budget
against concurrency, per-position acceptance, open-loop goodput."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.serve_bench.cells import (
    by_arm,
    cell_load,
    color,
    load_label,
    server,
    summary,
    throughput,
    throughput_label,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _figure(ncols: int = 1) -> tuple[Figure, list]:
    """A pyplot-free figure on the Agg canvas: no display needed and no global figure state to leak. matplotlib
    loads here, on the first figure (0.9 s of an import of this module otherwise)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0 * ncols, 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=120)
    return path


def _plot_pareto(results: dict, path: Path) -> Path | None:
    arms = by_arm(results.get("cells", []), "closed")
    fig, (ax,) = _figure()
    drawn = False
    for arm, cells in arms.items():
        points = [(summary(c, "per_user_tok_s_median"), throughput(c, results), load_label(c)) for c in cells]
        points = [p for p in points if p[0] is not None and p[1] is not None]
        if not points:
            continue
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=color(arm), label=arm)
        for x, y, c in points:
            ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        drawn = True
    if not drawn:
        return None
    ax.set(xlabel="per-user tok/s (median)", ylabel=throughput_label(results),
           title="Throughput vs per-user speed (closed loop)")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _series(cells: list[dict], value: Callable[[dict], float | None]) -> tuple[list[float], list[float]]:
    points = [(cell_load(c), value(c)) for c in cells]
    points = [(x, y) for x, y in points if y is not None and not math.isnan(x)]
    return [x for x, _ in points], [y for _, y in points]


def _plot_verify_budget(results: dict, path: Path) -> Path | None:
    arms = {a: c for a, c in by_arm(results.get("cells", []), "closed").items() if a != "none"}
    panels = [("mean_verify_len", "verified draft tokens per request per step (ℓ̄)"),
              ("mean_verify_budget", "verify budget of the dspark plan (K̄)")]
    panels = [p for p in panels if any(_series(cells, lambda c, k=p[0]: server(c, k))[0] for cells in arms.values())]
    if not panels:
        return None
    fig, axes = _figure(len(panels))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for arm, cells in arms.items():
            xs, ys = _series(cells, lambda c, k=key: server(c, k))
            if xs:
                ax.plot(xs, ys, marker="o", color=color(arm), label=arm)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="max concurrency", ylabel=label, title=label.split(" (")[0])
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, path)


def _lowest_load_cells(results: dict) -> dict[str, dict]:
    """Each speculative arm's lowest-load cell with per-position data, closed loop first (least batching noise)."""
    chosen: dict[str, dict] = {}
    for mode in ("closed", "open"):
        for arm, cells in by_arm(results.get("cells", []), mode).items():
            with_data = [c for c in cells if server(c, "per_position_unconditional")]
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
            values = server(cell, key) or []
            points = [(k + 1, v) for k, v in enumerate(values) if v is not None]
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=color(arm),
                        label=f"{arm} ({cell['load'].get('mode')} {load_label(cell)})")
        ax.set(xlabel="draft position (1 = first)", ylabel="acceptance", title=title, ylim=(0, 1.05))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def _plot_open_loop(results: dict, path: Path) -> Path | None:
    arms = by_arm(results.get("cells", []), "open")
    if not arms:
        return None
    panels = [(lambda c: throughput(c, results), throughput_label(results))]
    if any(_series(cells, lambda c: summary(c, "request_goodput"))[0] for cells in arms.values()):
        panels.append((lambda c: summary(c, "request_goodput"), "request goodput (req/s meeting all SLOs)"))
    fig, axes = _figure(len(panels))
    for ax, (value, label) in zip(axes, panels, strict=True):
        for arm, cells in arms.items():
            xs, ys = _series(cells, value)
            if xs:
                ax.plot(xs, ys, marker="o", color=color(arm), label=arm)
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

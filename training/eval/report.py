"""`dspark eval`: τ and acceptance per domain for one or more drafters, γ values and temperatures, batch 1
(as DeepSpec evaluates) and batched; confidence calibration metrics of a_k before and after STS; JSON,
Markdown and a reliability diagram."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from drafter_worker.calibration import Calibration
from drafter_worker.drafter import Drafter
from services import chat_template
from services.calibration_metrics import auroc, brier, ece
from services.types import SamplingParams
from training.eval import evaluate
from training.eval.plots import plot_reliability


@dataclass(frozen=True, slots=True)
class EvalSpec:
    datasets: tuple[str, ...]
    gammas: tuple[int, ...]
    temperatures: tuple[float, ...]
    batches: tuple[int, ...]  # batch sizes to run; τ is reported for each
    prompts: int
    max_tokens: int
    seed: int = 980406


def read_prompts(datasets_dir: Path, domain: str, limit: int, tokenizer) -> list[list[int]]:
    """The first `limit` prompts of a set: a conversation written in dspark's turn format in the target's own
    chat template (Gemma's for Gemma), a completion prompt as it is."""
    rows = [json.loads(line) for line in (datasets_dir / f"{domain}.jsonl").read_text().splitlines()]
    out = []
    for row in rows[:limit]:
        messages = chat_template.parse(row["prompt"])
        out.append(tokenizer.encode(row["prompt"]) if messages is None else tokenizer.chat_ids(messages))
    return out


def confidence_metrics(log: evaluate.CycleLog, gamma: int, calibration: Calibration | None) -> dict:
    """ECE / AUROC / Brier of a_k per position, raw and (when given) calibrated, with the curves to plot."""
    if not log.accepted:
        return {}
    z, labels, valid = log.tensors(gamma)
    series = {"raw": torch.sigmoid(z).cumprod(dim=1)}
    if calibration is not None:
        series["calibrated"] = calibration.apply(z).cumprod(dim=1)
    out, curves = {}, {}
    for name, survival in series.items():
        rows, curves[name] = [], {}
        for k in range(gamma):
            m = valid[:, k]
            if m.sum() == 0:
                continue
            p, y = survival[m, k].numpy(), labels[m, k].float().numpy()
            curves[name][k + 1] = (p, y)
            rows.append({"k": k + 1, "n": int(m.sum()), "ece": ece(p, y), "auroc": auroc(p, y), "brier": brier(p, y),
                         "mean_pred": float(p.mean()), "mean_label": float(y.mean())})
        out[name] = rows
    return {"metrics": out, "curves": curves}


def evaluate_drafter(target, drafter: Drafter, calibration: Calibration | None, prompts: dict[str, list[list[int]]],
                     spec: EvalSpec, stop_ids: tuple[int, ...], gamma: int, temperature: float,
                     plot_path: Path | None = None, log=None) -> dict:
    params = SamplingParams(temperature=temperature, max_tokens=spec.max_tokens, seed=spec.seed)
    calibration = None if calibration is None else calibration.for_rows(temperature == 0)  # the fit of this kind
    domains, pooled = {}, evaluate.CycleLog()
    for domain, ids in prompts.items():
        entry = {}
        for batch in spec.batches:
            drafter.generator.manual_seed(spec.seed)
            run = evaluate.run(target, drafter, ids, gamma, params, stop_ids, batch)
            entry[f"batch{batch}"] = run.summary(gamma)
            if batch == spec.batches[-1]:
                pooled.logits.extend(run.cycles.logits)
                pooled.accepted.extend(run.cycles.accepted)
                conf = confidence_metrics(run.cycles, gamma, calibration)
                if conf:
                    entry["confidence"] = conf["metrics"]
            if log:
                log(f"  {domain} γ={gamma} T={temperature} batch {batch}: τ={entry[f'batch{batch}']['tau']:.3f}")
        domains[domain] = entry
    result = {"gamma": gamma, "temperature": temperature, "datasets": domains,
              "mean_tau": {f"batch{b}": sum(d[f"batch{b}"]["tau"] for d in domains.values()) / len(domains)
                           for b in spec.batches}}
    pooled_conf = confidence_metrics(pooled, gamma, calibration)
    if pooled_conf:
        result["confidence"] = pooled_conf["metrics"]
        if plot_path is not None:
            plot_reliability(pooled_conf["curves"], plot_path, title=f"a_k reliability, γ={gamma}, T={temperature}")
            result["reliability_png"] = str(plot_path)
    return result


def markdown(report: dict) -> str:
    """Tables: τ per domain for every (drafter, γ, T, batch); per-position acceptance; calibration."""
    lines = [f"# Drafter acceptance on {report['target']}", "",
             f"`{report.get('command', 'dspark eval')}`: {report['prompts']} prompts per dataset "
             f"(`{report.get('datasets_dir', 'benchmarks/datasets')}/`), at most {report['max_tokens']} new tokens, "
             "the full block verified every cycle (no scheduler). τ counts the bonus / recovered token.", "",
             "| drafter | γ | T | batch | " + " | ".join(report["datasets"]) + " | mean τ |",
             "|---|---|---|---|" + "---|" * (len(report["datasets"]) + 1)]
    for name, runs in report["drafters"].items():
        for r in runs:
            for batch in r["mean_tau"]:
                taus = " | ".join(f"{d[batch]['tau']:.3f}" for d in r["datasets"].values())
                lines.append(f"| {name} | {r['gamma']} | {r['temperature']:g} | {batch.removeprefix('batch')} | "
                             f"{taus} | {r['mean_tau'][batch]:.3f} |")
    lines += ["", "Per-position acceptance (last batch size, all domains pooled by cycles): unconditional "
              "(prefix survival) / conditional.", ""]
    for name, runs in report["drafters"].items():
        for r in runs:
            batch = list(r["mean_tau"])[-1]
            uncond = _pooled(r, batch, "accept_rate_at_k")
            cond = [u / p if p else 0.0 for u, p in zip(uncond, [1.0, *uncond[:-1]], strict=True)]
            cells = " ".join(f"{u:.2f}/{c:.2f}" for u, c in zip(uncond, cond, strict=True))
            lines.append(f"- {name} γ={r['gamma']} T={r['temperature']:g}: {cells}")
    conf_lines = []
    for name, runs in report["drafters"].items():
        for r in runs:
            for series, rows in r.get("confidence", {}).items():
                cells = " ".join(f"k{row['k']}:{100 * row['ece']:.1f}%/{row['auroc']:.3f}" for row in rows)
                conf_lines.append(f"- {name} γ={r['gamma']} T={r['temperature']:g} {series}: {cells}")
    if conf_lines:
        lines += ["", "Confidence of a_k (ECE / AUROC per position, all domains pooled):", "", *conf_lines]
    return "\n".join(lines) + "\n"


def command_line(argv: list[str]) -> str:
    return "dspark " + " ".join(argv)


def _pooled(run: dict, batch: str, key: str) -> list[float]:
    """Cycle-weighted mean over domains of a per-position rate."""
    rows = [(d[batch][key], d[batch]["cycles"]) for d in run["datasets"].values()]
    width = max(len(v) for v, _ in rows)
    total = sum(c for _, c in rows) or 1
    return [sum((v[k] if k < len(v) else 0.0) * c for v, c in rows) / total for k in range(width)]

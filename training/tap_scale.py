"""Per-tap input scale for training: each tap layer's features reach the context projection at unit RMS.

A real model's residual stream grows with depth (Gemma 3 270M's taps at layers 1 / 9 / 16 have RMS about
37 / 258 / 1,205), and `fc(concat taps)` then starts out reading the deepest tap almost alone: Adam moves every
weight by about the same step, so a shallow tap's columns need ~30 × the steps to matter as much. Training
multiplies tap i by s_i = 1 / RMS_i (fixed, measured on the cache); export folds s_i into the columns of fc that
read tap i, so a shipped drafter takes the raw taps and serving is unchanged. A run that starts from shipped
weights unfolds them first (the same function, in the scaled coordinates).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from training.target_cache import TargetCache

FILE = "tap_scale.json"


def measure(cache: TargetCache, num_taps: int, sequences: int = 64) -> torch.Tensor:
    """s [T]: 1 / RMS of each tap's features over the response rows of the cache's first `sequences`."""
    sums, rows = torch.zeros(num_taps, dtype=torch.float64), 0
    for i in range(min(sequences, len(cache))):
        s = cache[i]
        x = s.taps[s.loss_mask].double()  # [n, T*d]
        sums += x.view(len(x), num_taps, -1).pow(2).mean(-1).sum(0)
        rows += len(x)
    return (sums / max(rows, 1)).rsqrt().float()


def for_run(run_dir: Path, cache: TargetCache, num_taps: int) -> torch.Tensor:
    """The run's scale: measured once and kept in the run directory, so a resumed run scales as it began."""
    path = run_dir / FILE
    if path.is_file():
        return torch.tensor(json.loads(path.read_text())["scale"])
    scale = measure(cache, num_taps)
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"scale": scale.tolist(), "rms": scale.reciprocal().tolist()}) + "\n")
    return scale


def apply(taps: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # [..., T*d] → [..., T*d]
    shape = taps.shape
    return (taps.view(*shape[:-1], len(scale), -1) * scale.to(taps)[:, None]).view(shape)


@torch.no_grad()
def fold(model: torch.nn.Module, scale: torch.Tensor) -> None:
    """fc's columns for tap i × s_i: the model now takes raw taps (export)."""
    w = model.context.fc.weight  # [d, T*d]
    w.copy_(apply(w, scale))


@torch.no_grad()
def unfold(model: torch.nn.Module, scale: torch.Tensor) -> None:
    """fc's columns for tap i ÷ s_i: shipped weights, for scaled taps (a run starting from them)."""
    w = model.context.fc.weight
    w.copy_(apply(w, scale.reciprocal()))

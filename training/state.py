"""Resumable training state: model, optimizer, step and elapsed time in `run_dir/state.pt`."""

from __future__ import annotations

from pathlib import Path

import torch


def save_state(run_dir: Path, model, opt, step: int, elapsed: float, config: dict) -> None:
    tmp = run_dir / "state.pt.tmp"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "elapsed_s": elapsed,
                "config": config}, tmp)
    tmp.replace(run_dir / "state.pt")  # atomic: a kill mid-save leaves the previous state


def resume_state(run_dir: Path, model, opt) -> tuple[int, float]:
    """(step, elapsed seconds) of the saved state loaded into model and opt; (0, 0.0) when there is none."""
    path = run_dir / "state.pt"
    if not path.is_file():
        return 0, 0.0
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return int(state["step"]), float(state["elapsed_s"])

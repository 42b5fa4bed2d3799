"""A compact copy of a drafter run that git can carry, so that a fresh machine resumes where a session stopped.

`run_dir/state.pt` holds every parameter (the frozen ones shared with the target too) and fp32 Adam moments:
~70 MB for DSpark v2, most of it not needed to resume. The mirror (`mirror_dir/resume.pt`) holds only the
trainable parameters in fp32, the Adam moments in bf16 (an estimate of a gradient's mean and square keeps its
use at 8 bits of mantissa) and the best weights when they are not the current ones, beside `best.json` and
`log.jsonl` as text: ~35 MB for DSpark v2. A resume from it is not bit-identical to one from `state.pt` (the
moments were rounded), which is why `state.pt` wins when both exist.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

_TEXT = ("best.json", "log.jsonl")


def _trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def _cast_moments(slot: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if k in ("exp_avg", "exp_avg_sq") else v for k, v in slot.items()}


def save_mirror(mirror_dir: Path, run_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int,
                elapsed: float, best_step: int) -> None:
    mirror_dir.mkdir(parents=True, exist_ok=True)
    opt_state = opt.state_dict()  # its per-parameter dicts are the optimizer's own: rounded copies, not in place
    opt_state["state"] = {i: _cast_moments(slot, torch.bfloat16) for i, slot in opt_state["state"].items()}
    best = None
    if best_step and best_step != step and (run_dir / "best.pt").is_file():
        names = set(_trainable(model))
        best = {k: v for k, v in torch.load(run_dir / "best.pt", weights_only=True).items() if k in names}
    tmp = mirror_dir / "resume.pt.tmp"
    torch.save({"trainable": _trainable(model), "optimizer": opt_state, "step": step, "elapsed_s": elapsed,
                "best": best}, tmp)
    tmp.replace(mirror_dir / "resume.pt")
    for name in _TEXT:
        if (run_dir / name).is_file():
            shutil.copyfile(run_dir / name, mirror_dir / name)


def load_mirror(mirror_dir: Path, run_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer
                ) -> tuple[int, float]:
    """(step, elapsed seconds) of the mirror loaded into model and opt, its best weights and text files
    restored into run_dir; (0, 0.0) when there is no mirror."""
    path = mirror_dir / "resume.pt"
    if not path.is_file():
        return 0, 0.0
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["trainable"], strict=False)
    opt_state = saved["optimizer"]
    opt_state["state"] = {i: _cast_moments(slot, torch.float32) for i, slot in opt_state["state"].items()}
    opt.load_state_dict(opt_state)
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in _TEXT:
        if (mirror_dir / name).is_file():
            shutil.copyfile(mirror_dir / name, run_dir / name)
    best = model.state_dict()
    if saved["best"] is not None:
        best = {**best, **saved["best"]}
    if (run_dir / "best.json").is_file():
        torch.save(best, run_dir / "best.pt")
    return int(saved["step"]), float(saved["elapsed_s"])

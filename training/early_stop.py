"""Early stopping on held-out acceptance: keep the best weights, stop after `patience` evaluations without one.

The score is the expected accepted length of a block under the per-slot held-out acceptance rates a_k
(teacher-forced, T = 1): Σ_k Π_{j ≤ k} a_j — what a drafter is for, rather than its loss, whose weighting
differs per method. State lives in `run_dir/best.json` (score, step, evaluations since the best, stopped)
and `run_dir/best.pt` (the weights), so a resumed run keeps counting where it left off.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


def expected_accepted(accept_at_k: list[float]) -> float:
    """Σ_k Π_{j ≤ k} a_j: the mean number of drafts a chain of these per-slot acceptance rates keeps."""
    total, survive = 0.0, 1.0
    for a in accept_at_k:
        survive *= a
        total += survive
    return total


@dataclass(slots=True)
class EarlyStop:
    patience: int  # evaluations without a better score before stopping; 0: never stop early
    min_delta: float = 1e-3  # a better score must beat the best by this much
    best: float = -math.inf
    best_step: int = 0
    since: int = 0
    last_step: int = 0  # the newest evaluation counted (a resumed run re-evaluates steps after its state)
    stopped: bool = False

    @classmethod
    def load(cls, run_dir: Path, patience: int, min_delta: float = 1e-3) -> EarlyStop:
        path = run_dir / "best.json"
        keeper = cls(patience, min_delta)
        if path.is_file():
            saved = json.loads(path.read_text())
            keeper.best, keeper.best_step, keeper.since = saved["best"], saved["best_step"], saved["since"]
            keeper.last_step, keeper.stopped = saved["last_step"], saved["stopped"]
        return keeper

    def update(self, run_dir: Path, model: torch.nn.Module, step: int, score: float) -> bool:
        """Record the evaluation of `step`; save the weights when it is the best. True: stop training."""
        if step <= self.last_step:
            return self.stopped
        self.last_step = step
        if score > self.best + self.min_delta:
            self.best, self.best_step, self.since = score, step, 0
            tmp = run_dir / "best.pt.tmp"
            torch.save(model.state_dict(), tmp)
            tmp.replace(run_dir / "best.pt")
        else:
            self.since += 1
        self.stopped = self.patience > 0 and self.since >= self.patience
        record = {k: v for k, v in asdict(self).items() if k not in ("patience", "min_delta")}
        (run_dir / "best.json").write_text(json.dumps(record))
        return self.stopped

    def restore_best(self, run_dir: Path, model: torch.nn.Module) -> int | None:
        """Load the best weights into `model`; their step, or None when no evaluation was saved."""
        path = run_dir / "best.pt"
        if not path.is_file():
            return None
        model.load_state_dict(torch.load(path, weights_only=True))
        return self.best_step

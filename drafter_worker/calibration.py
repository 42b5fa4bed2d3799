"""The calibration of a drafter's confidence head, as a drafter applies it.

Vocabulary:
- z_k: the confidence-head logit of draft position k (k = 1..γ);
- c_k = sigmoid(z_k / T_k): the calibrated conditional estimate P(draft k accepted | drafts 1..k-1 accepted);
- a_k = prod_{i<=k} c_i: the prefix survival, the estimate that drafts 1..k are all accepted;
- label of a_k: 1 when the verifier accepted draft positions 1..k (a prefix label, so labels are cumulative).

Why calibrate the product rather than each c_k on its own: the scheduler consumes absolute survival
probabilities. The expected number of accepted tokens of a block of length ℓ is sum_{k<=ℓ} a_k, and the
choice of ℓ (and of how to split verifier budget across requests) compares that expectation against the
verification cost in absolute units. A head whose a_k is over-confident makes every long draft look
profitable. Calibrating each c_k separately on its conditional population would not make the product
calibrated either, because per-position errors compound multiplicatively; fitting T_k with T_1..T_{k-1}
already fixed, against the prefix labels, targets the quantity the scheduler reads, and corrects at step
k whatever residual bias the earlier factors left.

The fits that produce one (STS: temperature only; Platt: temperature and bias) are training's:
`training/calibration_fit.py`. A drafter only loads and applies them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

METHOD = "sts"
METHODS = ("sts", "platt")  # temperature only; temperature and bias (`training/calibration_fit.py`)


@dataclass(slots=True)
class Calibration:
    """Per-position temperatures of the confidence head, and the diagnostics of the fit that produced them."""

    position_temperatures: list[float]  # T_1..T_γ
    serving_temperature: float  # the sampling temperature of the rollouts the fit saw
    bins: int = 20
    ece_before: list[float] = field(default_factory=list)  # ECE of a_k with every T = 1
    ece_after: list[float] = field(default_factory=list)  # ECE of a_k with the fitted T
    samples: int = 0  # rollout rows with at least one valid position
    # b_1..b_γ of c_k = sigmoid(z_k / T_k + b_k): empty for STS. A bias moves sigmoid(0) off ½, which no
    # temperature can (a head whose logit 0 means 80 % acceptance stays miscalibrated under STS).
    position_biases: list[float] = field(default_factory=list)
    method: str = METHOD
    # The fit at T = 0 shipped beside this one (fitted at T > 0): greedy drafts are surer than sampled ones, so
    # each kind of request gets the fit of its own kind (`for_rows`); stored in the same calibration.json.
    greedy: Calibration | None = None

    def __post_init__(self) -> None:
        temps = [float(t) for t in self.position_temperatures]
        if not temps:
            raise ValueError("a Calibration needs at least one position temperature")
        if not all(math.isfinite(t) and t > 0 for t in temps):
            raise ValueError(f"position temperatures must be finite and > 0, got {temps}")
        self.position_temperatures = temps
        biases = [float(b) for b in self.position_biases]
        if not all(math.isfinite(b) for b in biases):
            raise ValueError(f"position biases must be finite, got {biases}")
        self.position_biases = biases
        if self.method not in METHODS:
            raise ValueError(f"calibration method {self.method!r}: expected one of {METHODS}")
        if self.greedy is not None and not (self.greedy.serving_temperature == 0 < self.serving_temperature):
            raise ValueError("a greedy fit (T = 0) goes beside a fit at T > 0")

    def for_rows(self, greedy: bool) -> Calibration | None:
        """The fit for greedy rows (fitted at T = 0) or sampled ones (at T > 0); None when none was made: a fit
        at T = 1 applied to greedy drafts makes them look worse than they are."""
        if greedy:
            return self.greedy if self.greedy is not None else (self if self.serving_temperature == 0 else None)
        return self if self.serving_temperature > 0 else None

    def beside(self, other: Calibration | None) -> Calibration:
        """This fit, keeping `other`'s fit of the other kind (a greedy fit joins a sampled one, or the reverse)."""
        if other is None:
            return self
        if self.serving_temperature == 0:
            return self if other.serving_temperature == 0 else dataclasses.replace(other, greedy=self)
        kept = other if other.serving_temperature == 0 else other.greedy
        return dataclasses.replace(self, greedy=kept)

    def temperatures(self, gamma: int) -> torch.Tensor:
        """T for positions 1..gamma as float64 [gamma]; positions past the fitted ones reuse the last T."""
        fitted = self.position_temperatures
        temps = fitted[:gamma] + [fitted[-1]] * max(0, gamma - len(fitted))
        return torch.tensor(temps, dtype=torch.float64)

    def biases(self, gamma: int) -> torch.Tensor:
        """b for positions 1..gamma as float64 [gamma] (zeros for STS); past the fitted ones the last b."""
        fitted = self.position_biases or [0.0]
        return torch.tensor(fitted[:gamma] + [fitted[-1]] * max(0, gamma - len(fitted)), dtype=torch.float64)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Calibrated conditional acceptance c = sigmoid(z / T + b) of logits z [..., γ'], same shape and dtype."""
        gamma = logits.shape[-1]
        temps = self.temperatures(gamma).to(device=logits.device)  # [γ']
        biases = self.biases(gamma).to(device=logits.device)  # [γ']
        # In float64 so a half-precision head does not round z / T before the sigmoid.
        return torch.sigmoid(logits.to(torch.float64) / temps + biases).to(logits.dtype)

    def survival(self, logits: torch.Tensor) -> torch.Tensor:
        """Calibrated prefix survival a_k = prod_{i<=k} c_i of logits z [..., γ'], same shape."""
        return torch.cumprod(self.apply(logits), dim=-1)

    def save(self, path: str | Path) -> None:
        data = asdict(self)
        Path(path).write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not a JSON calibration file ({err})") from err
        return cls._from_dict(data, path)

    @classmethod
    def _from_dict(cls, data, path) -> Calibration:
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
        method = data.pop("method", None)
        if method not in METHODS:
            raise ValueError(f"{path}: calibration method is {method!r}, expected one of {METHODS}")
        try:
            return cls(
                position_temperatures=[float(t) for t in data["position_temperatures"]],
                serving_temperature=float(data["serving_temperature"]),
                bins=int(data.get("bins", 20)),
                ece_before=[float(e) for e in data.get("ece_before", [])],
                ece_after=[float(e) for e in data.get("ece_after", [])],
                samples=int(data.get("samples", 0)),
                position_biases=[float(b) for b in data.get("position_biases", [])],
                method=method,
                greedy=None if data.get("greedy") is None else cls._from_dict(data["greedy"], path),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: malformed calibration file ({type(err).__name__}: {err})") from err

"""Sequential Temperature Scaling (STS) of a drafter's confidence head.

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

Why the ranking survives: z -> sigmoid(z / T) with T > 0 is strictly increasing, so at every position the
order of c_k over drafts (and so the head's accept/reject discrimination, its AUROC) is exactly that of
z_k, and a_1 = c_1 keeps its order too. For k >= 2 the order of a_k across drafts is only preserved when
the T_i are equal: the product mixes positions that were rescaled differently, so two drafts with equal
raw a_k can be separated by calibration. That is the intended trade: the fit changes the absolute level
of a_k, not what the head can tell apart at any single position.

The fit is a 1-D grid search per position minimising the ECE of a_k (equal-width bins, as in
`services.calibration_metrics.ece`), vectorised over the grid: candidate a_k for a block of grid
temperatures at once, binned with one scatter-add. The recorded before/after ECEs use the reference
metric in float64.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from services.calibration_metrics import ece

METHOD = "sts"
METHODS = ("sts", "platt")  # temperature only; temperature and bias (`training/calibration_fit.py`)
_GRID_SIZE = 200
_GRID_MIN, _GRID_MAX = 0.05, 20.0
# ECE values within this of the minimum count as ties: the grid search runs in float32 (errors ~1e-6), so
# exact equality would make the choice among near-equal temperatures depend on rounding.
_TIE_ABS, _TIE_REL = 1e-5, 1e-4
# Grid rows per block of the search: [16, 20000] float32 buffers stay in cache.
_GRID_BLOCK = 16


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


def default_grid() -> torch.Tensor:
    """200 temperatures log-spaced on [0.05, 20] plus exactly 1.0, sorted, float64 [201]."""
    spaced = torch.logspace(math.log10(_GRID_MIN), math.log10(_GRID_MAX), _GRID_SIZE, dtype=torch.float64)
    return torch.unique(torch.cat([spaced, torch.ones(1, dtype=torch.float64)]))


def _grid_ece(
    prefix: torch.Tensor,  # [n] a_{k-1} of the rows, fitted temperatures applied
    z: torch.Tensor,  # [n] logits of position k
    labels: torch.Tensor,  # [n] prefix labels of position k
    grid: torch.Tensor,  # [G] candidate T_k
    bins: int,
) -> torch.Tensor:
    """ECE of a_k = a_{k-1} * sigmoid(z / T) for every T in the grid, float64 [G].

    The search runs in float32 over blocks of grid rows: it halves the memory traffic of float64 and keeps
    the working set in cache, and the float32 error (~1e-6 in ECE) sits inside the tie tolerance.
    """
    prefix, z, labels = (t.to(torch.float32) for t in (prefix, z, labels))
    temps = grid.to(torch.float32)
    n = z.numel()
    rows = min(_GRID_BLOCK, temps.numel())
    a = torch.empty(rows, n, dtype=torch.float32)  # [B, n] candidate a_k, then a_k - label
    idx = torch.empty(rows, n, dtype=torch.int64)  # [B, n] bin of each candidate a_k
    gap = torch.empty(rows, bins, dtype=torch.float32)  # [B, bins] signed sum of a_k - label per bin
    out = torch.empty(temps.numel(), dtype=torch.float64)  # [G]
    for start in range(0, temps.numel(), rows):
        m = min(rows, temps.numel() - start)
        a_m, idx_m, gap_m = a[:m], idx[:m], gap[:m]
        torch.div(z, temps[start : start + m, None], out=a_m)
        a_m.sigmoid_().mul_(prefix)
        # Truncation toward zero is the bin rule of calibration_metrics.ece; a_k <= 1 so only 1.0 needs the clamp.
        idx_m.copy_(a_m * bins).clamp_max_(bins - 1)
        a_m.sub_(labels)
        # count/n * |mean a - mean y| per bin equals |sum (a - y)| / n, so one signed scatter-add per grid row.
        gap_m.zero_().scatter_add_(1, idx_m, a_m)
        out[start : start + m] = gap_m.abs().sum(dim=1, dtype=torch.float64)
    return out / n


def fit_sts(
    logits: torch.Tensor,  # [N, γ] confidence-head logits z
    accepted: torch.Tensor,  # [N, γ] bool prefix labels: drafts 1..k all accepted
    valid: torch.Tensor | None = None,  # [N, γ] bool: which (row, position) pairs to fit on; None = all
    serving_temperature: float = 1.0,
    grid: torch.Tensor | None = None,  # [G] candidate temperatures; None = default_grid()
    bins: int = 20,
) -> Calibration:
    """Fit T_1..T_γ left to right, each minimising the ECE of a_k over the rows valid at k, earlier T fixed.

    Among temperatures whose ECE ties the minimum, the one closest to 1 in log space wins, so a position that
    is already calibrated (or has no valid rows) keeps T = 1.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, γ], got shape {tuple(logits.shape)}")
    if accepted.shape != logits.shape:
        raise ValueError(f"accepted shape {tuple(accepted.shape)} != logits shape {tuple(logits.shape)}")
    if valid is None:
        valid = torch.ones_like(accepted, dtype=torch.bool)
    elif valid.shape != logits.shape:
        raise ValueError(f"valid shape {tuple(valid.shape)} != logits shape {tuple(logits.shape)}")
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    if not (math.isfinite(serving_temperature) and serving_temperature >= 0):
        raise ValueError(f"serving_temperature must be finite and >= 0, got {serving_temperature}")
    grid = default_grid() if grid is None else grid.detach().to("cpu", torch.float64).reshape(-1)
    if grid.numel() == 0 or not bool(torch.all(torch.isfinite(grid) & (grid > 0))):
        raise ValueError("grid must be a non-empty set of finite temperatures > 0")

    # Candidate order for tie-breaking: closest to 1 in log space first, then the smaller T.
    by_grid = torch.sort(grid, stable=True)
    order = by_grid.indices[torch.sort(by_grid.values.log().abs(), stable=True).indices]  # [G]
    ranked = grid[order]  # [G]

    z = logits.detach().to("cpu", torch.float64)  # [N, γ]
    y = accepted.detach().to("cpu", torch.float64)  # [N, γ]
    mask = valid.detach().to("cpu", torch.bool)  # [N, γ]
    n, gamma = z.shape
    a_fit = torch.ones(n, dtype=torch.float64)  # [N] a_{k-1} with the fitted temperatures
    a_raw = torch.ones(n, dtype=torch.float64)  # [N] a_{k-1} with every T = 1
    temps: list[float] = []
    before: list[float] = []
    after: list[float] = []
    for k in range(gamma):
        rows = mask[:, k]  # [N]
        raw_k = a_raw * torch.sigmoid(z[:, k])  # [N]
        if bool(rows.any()):
            scores = _grid_ece(a_fit[rows], z[rows, k], y[rows, k], ranked, bins)  # [G]
            best = scores.min()
            tied = scores <= best + _TIE_ABS + _TIE_REL * best  # [G]
            t = float(ranked[int(torch.nonzero(tied)[0])])
        else:
            t = 1.0
        fit_k = a_fit * torch.sigmoid(z[:, k] / t)  # [N]
        before.append(ece(raw_k[rows], y[rows, k], bins))
        after.append(ece(fit_k[rows], y[rows, k], bins))
        temps.append(t)
        a_raw, a_fit = raw_k, fit_k
    return Calibration(
        position_temperatures=temps,
        serving_temperature=float(serving_temperature),
        bins=bins,
        ece_before=before,
        ece_after=after,
        samples=int(mask.any(dim=1).sum()),
    )

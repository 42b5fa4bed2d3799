"""Fitting a drafter's confidence-head calibration (`drafter_worker/calibration.py: Calibration`) on held-out
cycles, left to right over the block's positions: STS (temperature only) and Platt (temperature and bias).

Platt: c_k = sigmoid(z_k / T_k + b_k), a_k = Π_{i≤k} c_i. STS (`fit_sts`) fits T_k
alone, which rescales the logit but cannot move sigmoid(0) = ½: a head whose logit 0 really means 80 %
acceptance stays off by 30 points there. Here each position's (T_k, b_k) minimises the log loss of a_k against
its prefix label (drafts 1..k all accepted) over the rows that reached k, with T_1..T_{k-1} and b_1..b_{k-1}
fixed, so like STS it targets the survival the scheduler reads. Log loss is a proper scoring rule: its minimum
is calibrated, and unlike the ECE it is smooth, so two parameters per position fit with L-BFGS in float64.

STS keeps the ranking:  z -> sigmoid(z / T) with T > 0 is strictly increasing, so at every position the
order of c_k over drafts (and so the head's accept/reject discrimination, its AUROC) is exactly that of
z_k, and a_1 = c_1 keeps its order too. For k >= 2 the order of a_k across drafts is only preserved when
the T_i are equal: the product mixes positions that were rescaled differently, so two drafts with equal
raw a_k can be separated by calibration. That is the intended trade: the fit changes the absolute level
of a_k, not what the head can tell apart at any single position.

Its fit is a 1-D grid search per position minimising the ECE of a_k (equal-width bins, as in
`services.calibration_metrics.ece`), vectorised over the grid: candidate a_k for a block of grid
temperatures at once, binned with one scatter-add. The recorded before/after ECEs use the reference
metric in float64.
"""

from __future__ import annotations

import math

import torch

from drafter_worker.calibration import Calibration
from services.calibration_metrics import ece

_GRID_SIZE = 200
_GRID_MIN, _GRID_MAX = 0.05, 20.0
# ECE values within this of the minimum count as ties: the grid search runs in float32 (errors ~1e-6), so
# exact equality would make the choice among near-equal temperatures depend on rounding.
_TIE_ABS, _TIE_REL = 1e-5, 1e-4
# Grid rows per block of the search: [16, 20000] float32 buffers stay in cache.
_GRID_BLOCK = 16
MAX_LOG_SCALE, MAX_BIAS = 4.0, 20.0  # |log(1/T)| and |b|: a position with one label kind cannot run off


def _fit_position(prefix: torch.Tensor, z: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(T, b) minimising the log loss of prefix · sigmoid(z / T + b) against y (all float64 [n])."""
    params = torch.zeros(2, dtype=torch.float64, requires_grad=True)  # log(1/T), b
    opt = torch.optim.LBFGS([params], lr=1.0, max_iter=200, tolerance_grad=1e-10, line_search_fn="strong_wolfe")
    log_prefix = prefix.clamp_min(1e-12).log()

    def closure():
        opt.zero_grad()
        scale = params[0].clamp(-MAX_LOG_SCALE, MAX_LOG_SCALE).exp()
        logit_c = z * scale + params[1].clamp(-MAX_BIAS, MAX_BIAS)
        log_a = log_prefix + torch.nn.functional.logsigmoid(logit_c)  # log a_k
        log_not_a = torch.log1p(-log_a.exp().clamp_max(1 - 1e-12))  # log (1 − a_k)
        loss = -(y * log_a + (1 - y) * log_not_a).mean()
        loss.backward()
        return loss

    opt.step(closure)
    log_scale, bias = params.detach().tolist()
    log_scale = max(-MAX_LOG_SCALE, min(MAX_LOG_SCALE, log_scale))
    return math.exp(-log_scale), max(-MAX_BIAS, min(MAX_BIAS, bias))


def fit_platt(
    logits: torch.Tensor,  # [N, γ] confidence-head logits z
    accepted: torch.Tensor,  # [N, γ] bool prefix labels: drafts 1..k all accepted
    valid: torch.Tensor | None = None,  # [N, γ] bool: which (row, position) pairs to fit on; None = all
    serving_temperature: float = 1.0,
    bins: int = 20,
) -> Calibration:
    """Fit (T_k, b_k) for k = 1..γ in order; a position with no valid rows keeps T = 1, b = 0."""
    if logits.dim() != 2 or accepted.shape != logits.shape:
        raise ValueError(f"logits and accepted must be [N, γ] alike, got {tuple(logits.shape)}, "
                         f"{tuple(accepted.shape)}")
    z = logits.detach().to("cpu", torch.float64)  # [N, γ]
    y = accepted.detach().to("cpu", torch.float64)  # [N, γ]
    mask = torch.ones_like(y, dtype=torch.bool) if valid is None else valid.detach().to("cpu", torch.bool)
    n, gamma = z.shape
    a_fit, a_raw = torch.ones(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64)  # [N] a_{k-1}
    temps, biases, before, after = [], [], [], []
    for k in range(gamma):
        rows = mask[:, k]  # [N]
        t, b = _fit_position(a_fit[rows], z[rows, k], y[rows, k]) if bool(rows.any()) else (1.0, 0.0)
        raw_k, fit_k = a_raw * torch.sigmoid(z[:, k]), a_fit * torch.sigmoid(z[:, k] / t + b)  # [N]
        before.append(ece(raw_k[rows], y[rows, k], bins))
        after.append(ece(fit_k[rows], y[rows, k], bins))
        temps.append(t)
        biases.append(b)
        a_raw, a_fit = raw_k, fit_k
    return Calibration(position_temperatures=temps, serving_temperature=float(serving_temperature), bins=bins,
                       ece_before=before, ece_after=after, samples=int(mask.any(dim=1).sum()),
                       position_biases=biases, method="platt")


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

"""Per-position temperature *and* bias of a confidence head, fitted left to right on held-out cycles.

c_k = sigmoid(z_k / T_k + b_k), a_k = Π_{i≤k} c_i. STS (`drafter_worker/calibration.py: fit_sts`) fits T_k
alone, which rescales the logit but cannot move sigmoid(0) = ½: a head whose logit 0 really means 80 %
acceptance stays off by 30 points there. Here each position's (T_k, b_k) minimises the log loss of a_k against
its prefix label (drafts 1..k all accepted) over the rows that reached k, with T_1..T_{k-1} and b_1..b_{k-1}
fixed, so like STS it targets the survival the scheduler reads. Log loss is a proper scoring rule: its minimum
is calibrated, and unlike the ECE it is smooth, so two parameters per position fit with L-BFGS in float64.
"""

from __future__ import annotations

import math

import torch

from drafter_worker.calibration import Calibration
from services.calibration_metrics import ece

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

"""The sparse MLPs of the released MTP modules, under their checkpoint names.

- `DeepseekMoE` (DeepSeek-V3): router `gate.weight` [E, d] with σ scores; experts are chosen by score +
  `gate.e_score_correction_bias` inside the `topk_group` best of `n_group` groups (a group's score: the sum of
  its two best biased scores), weighted by their *unbiased* scores, renormalised when `norm_topk_prob`, times
  `routed_scaling_factor`; plus `shared_experts` (one SwiGLU of width moe_intermediate_size · n_shared_experts).
- `QwenNextMoE` (Qwen3-Next): softmax router `gate.weight`, top-k (renormalised when `norm_topk_prob`), plus
  `shared_expert` scaled by σ(`shared_expert_gate`(x)).
Routing runs in fp32 (as both references do); experts are `experts.{e}.{gate,up,down}_proj`, SwiGLU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class MoeDims:
    experts: int  # E
    top_k: int
    width: int  # moe_intermediate_size
    shared_width: int  # the shared expert's intermediate size
    norm_topk_prob: bool
    scaling: float = 1.0  # routed_scaling_factor (DeepSeek)
    groups: int = 1  # n_group (DeepSeek)
    topk_groups: int = 1  # topk_group (DeepSeek)


class SwiGLU(nn.Module):
    def __init__(self, d: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, width, bias=False)
        self.up_proj = nn.Linear(d, width, bias=False)
        self.down_proj = nn.Linear(width, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def mix_experts(experts: nn.ModuleList, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """x [N, d], weights / chosen [N, k] → Σ_k weights · expert_chosen(x) [N, d]; only the experts hit run."""
    out = torch.zeros_like(x)
    for e in chosen.unique().tolist():
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        out.index_add_(0, rows, experts[e](x[rows]) * weights[rows, slot, None].to(x.dtype))
    return out


class _Router(nn.Module):
    def __init__(self, d: int, experts: int, corrected: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, d))
        if corrected:
            self.register_buffer("e_score_correction_bias", torch.zeros(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, d] → fp32 logits [N, E]
        return F.linear(x.float(), self.weight.float())


class DeepseekMoE(nn.Module):
    def __init__(self, d: int, m: MoeDims):
        super().__init__()
        self.dims = m
        self.gate = _Router(d, m.experts, corrected=True)
        self.experts = nn.ModuleList(SwiGLU(d, m.width) for _ in range(m.experts))
        self.shared_experts = SwiGLU(d, m.shared_width)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] → weights [N, k] fp32, chosen experts [N, k]."""
        m = self.dims
        scores = self.gate(x).sigmoid()  # [N, E]
        biased = scores + self.gate.e_score_correction_bias.float()
        grouped = biased.view(len(x), m.groups, -1)  # [N, G, E/G]
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [N, G]
        best = group_score.topk(m.topk_groups, dim=-1).indices
        allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)  # [N, G]
        biased = biased.masked_fill(~allowed.repeat_interleave(m.experts // m.groups, dim=1), float("-inf"))
        chosen = biased.topk(m.top_k, dim=-1).indices  # [N, k]
        weights = scores.gather(1, chosen)  # the unbiased scores: the bias only steers the choice
        if m.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * m.scaling, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., d] → [..., d]
        flat = x.reshape(-1, x.shape[-1])
        out = mix_experts(self.experts, flat, *self.route(flat)) + self.shared_experts(flat)
        return out.view_as(x)


class QwenNextMoE(nn.Module):
    def __init__(self, d: int, m: MoeDims):
        super().__init__()
        self.dims = m
        self.gate = _Router(d, m.experts, corrected=False)
        self.experts = nn.ModuleList(SwiGLU(d, m.width) for _ in range(m.experts))
        self.shared_expert = SwiGLU(d, m.shared_width)
        self.shared_expert_gate = nn.Linear(d, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = self.gate(x).softmax(-1)  # [N, E] fp32
        weights, chosen = probs.topk(self.dims.top_k, dim=-1)
        if self.dims.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (mix_experts(self.experts, flat, *self.route(flat)) + shared).view_as(x)

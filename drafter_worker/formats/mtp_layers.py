"""Attention of the released MTP modules, in the row-cache convention of dspark's chain drafters.

A chain drafter (`drafter_worker/chain_model.py`, driven by `Drafter._fold` / `_draft_chain`) turns rows into
queries [..., H, n, E] and per-row keys / values [..., Hkv, n, E(v)]; the `Drafter` keeps the context rows' keys
and values, concatenates rows along n and attends with a boolean mask [B, 1, n, m] (True = attend).

- `MlaAttention` (DeepSeek-V3 multi-head latent attention) caches the latent: key = [c; k_pe] and value = c,
  one shared head (Hkv = 1), where c = kv_a_layernorm(kv_a(x)) [r] and k_pe the roped [Dr] key part. The
  per-head no-RoPE keys and the values are W_UK·c and W_UV·c (kv_b_proj), so q_nope·k_nope = (W_UKᵀ q_nope)·c:
  queries are absorbed into the latent, [W_UKᵀ q_nope; q_pe], and W_UV is applied after attention. Exact up to
  fp32 summation order, and the cache is r + Dr per row instead of H·(Dn + Dr + Dv).
- `GatedAttention` (Qwen3-Next full attention): GQA with (1 + w) q/k norms (loaded as w + 1), RoPE on the first
  `rotary_dim` dims of each head, and the output gated by σ(gate) taken from q_proj's second half per head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.layers import RMSNorm
from services.rope import apply_rotary


@dataclass(frozen=True, slots=True)
class Yarn:
    """DeepSeek's YaRN scaling (`rope_scaling` type yarn); factor 1 means plain RoPE."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(theta: float, dim: int, yarn: Yarn) -> tuple[torch.Tensor, float]:
    """inv_freq [dim/2] and the cos/sin magnitude (YaRN's attention factor; 1 without scaling)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    plain = 1.0 / theta ** exponents  # [dim/2]
    if yarn.factor <= 1:
        return plain, 1.0

    def turning_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times in the window
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low = max(math.floor(turning_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(turning_dim(yarn.beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1 - ramp  # 1: short wavelengths kept (extrapolated), 0: long ones slowed by `factor`
    inv_freq = plain / yarn.factor * (1 - keep) + plain * keep
    if yarn.mscale and yarn.mscale_all_dim:
        return inv_freq, _mscale(yarn.factor, yarn.mscale) / _mscale(yarn.factor, yarn.mscale_all_dim)
    return inv_freq, _mscale(yarn.factor)


class PairRope:
    """cos/sin [P, dim/2] per position for DeepSeek's interleaved RoPE (pairs (x0, x1), (x2, x3), …)."""

    def __init__(self, theta: float, dim: int, yarn: Yarn, max_positions: int, device: torch.device):
        inv_freq, magnitude = rope_frequencies(theta, dim, yarn)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq).to(device)  # [P, dim/2]
        self.cos, self.sin = angles.cos() * magnitude, angles.sin() * magnitude

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., n, heads, dim] at positions [..., n] → rotated, de-interleaved ([evens'; odds']): the same
        permutation for queries and keys, so their dot products are the interleaved ones."""
        cos = self.cos[positions][..., None, :].to(x.dtype)  # [..., n, 1, dim/2]
        sin = self.sin[positions][..., None, :].to(x.dtype)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


@dataclass(frozen=True, slots=True)
class MlaDims:
    heads: int
    q_lora_rank: int | None  # None: one q_proj [H·(Dn + Dr), d]
    kv_lora_rank: int  # r
    nope: int  # Dn
    rope: int  # Dr
    value: int  # Dv
    theta: float
    yarn: Yarn
    eps: float

    @property
    def scale(self) -> float:
        """Softmax scale: (Dn + Dr)^−½, times YaRN's mscale(factor, mscale_all_dim)² (DeepSeek's rule)."""
        extra = _mscale(self.yarn.factor, self.yarn.mscale_all_dim) if self.yarn.mscale_all_dim else 1.0
        return (self.nope + self.rope) ** -0.5 * extra * extra


class MlaAttention(nn.Module):
    def __init__(self, d: int, m: MlaDims):
        super().__init__()
        self.dims = m
        qk = m.nope + m.rope
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(d, m.heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, m.eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, m.heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, m.kv_lora_rank + m.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, m.eps)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, m.heads * (m.nope + m.value), bias=False)
        self.o_proj = nn.Linear(m.heads * m.value, d, bias=False)

    def _up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [H, Dn, r], W_UV [H, Dv, r] (views, no copy)."""
        m = self.dims
        w = self.kv_b_proj.weight.view(m.heads, m.nope + m.value, m.kv_lora_rank)
        return w[:, : m.nope], w[:, m.nope :]

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope: PairRope):
        """x [..., n, d] → q [..., H, n, r + Dr], k [..., 1, n, r + Dr], v [..., 1, n, r], None (no gate)."""
        m = self.dims
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.unflatten(-1, (m.heads, m.nope + m.rope))  # [..., n, H, Dn + Dr]
        w_uk, _ = self._up()
        q_latent = torch.einsum("...hc,hcr->...hr", q[..., : m.nope], w_uk)  # [..., n, H, r]
        q_pe = rope.apply(q[..., m.nope :], positions)  # [..., n, H, Dr]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [..., n, r]
        k_pe = rope.apply(k_pe[..., None, :], positions)[..., 0, :]  # [..., n, Dr]
        q = torch.cat([q_latent, q_pe], dim=-1).transpose(-2, -3)  # [..., H, n, r + Dr]
        k = torch.cat([latent, k_pe], dim=-1)[..., None, :, :]  # [..., 1, n, r + Dr]
        return q, k, latent[..., None, :, :], None

    def attend(self, q, k, v, mask, gate=None) -> torch.Tensor:
        """q [B, H, n, r + Dr] over k [B, 1, m, r + Dr], v [B, 1, m, r] → [B, n, d]."""
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.dims.scale, enable_gqa=True)
        _, w_uv = self._up()
        o = torch.einsum("bhnr,hvr->bnhv", o, w_uv)  # [B, n, H, Dv]
        return self.o_proj(o.flatten(2))


@dataclass(frozen=True, slots=True)
class GatedDims:
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int  # head_dim · partial_rotary_factor
    theta: float
    eps: float


class GatedAttention(nn.Module):
    def __init__(self, d: int, g: GatedDims):
        super().__init__()
        self.dims = g
        self.q_proj = nn.Linear(d, g.heads * g.head_dim * 2, bias=False)  # per head [query; gate]
        self.k_proj = nn.Linear(d, g.kv_heads * g.head_dim, bias=False)
        self.v_proj = nn.Linear(d, g.kv_heads * g.head_dim, bias=False)
        self.o_proj = nn.Linear(g.heads * g.head_dim, d, bias=False)
        self.q_norm = RMSNorm(g.head_dim, g.eps)  # Qwen3-Next's (1 + w), loaded as w + 1
        self.k_norm = RMSNorm(g.head_dim, g.eps)

    def _rope(self, x: torch.Tensor, rope) -> torch.Tensor:
        """x [..., n, heads, Dh]: rotate-half RoPE on the first rotary_dim dims, the rest passed through."""
        r = self.dims.rotary_dim
        return torch.cat([apply_rotary(x[..., :r], *rope), x[..., r:]], dim=-1)

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope):
        """x [..., n, d] → q [..., H, n, Dh], k, v [..., Hkv, n, Dh], gate [..., n, H·Dh]; `rope` = cos, sin
        [..., n, 1, rotary_dim] at the rows' positions."""
        g = self.dims
        q, gate = self.q_proj(x).unflatten(-1, (g.heads, 2 * g.head_dim)).chunk(2, dim=-1)  # [..., n, H, Dh] each
        k = self.k_proj(x).unflatten(-1, (g.kv_heads, g.head_dim))
        v = self.v_proj(x).unflatten(-1, (g.kv_heads, g.head_dim))
        q = self._rope(self.q_norm(q), rope).transpose(-2, -3)
        k = self._rope(self.k_norm(k), rope).transpose(-2, -3)
        return q, k, v.transpose(-2, -3), gate.flatten(-2)

    def attend(self, q, k, v, mask, gate) -> torch.Tensor:
        """q [B, H, n, Dh] over k, v [B, Hkv, m, Dh], gate [B, n, H·Dh] → [B, n, d]."""
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # scale Dh^−½
        return self.o_proj(o.transpose(1, 2).flatten(2) * torch.sigmoid(gate))

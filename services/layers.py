"""Decoder building blocks: RMSNorm, GQA attention over a slot KV cache, SwiGLU MLP.

Module and parameter names follow Hugging Face Llama/Qwen so checkpoints load by name.
Attention is ragged: the new tokens of many requests arrive flattened as [N, ...] and each
request attends causally over its own cache slot only, so a position's output never depends
on what else shares the forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.attention import AttentionPlan, attend
from services.model_config import ModelConfig
from services.packed_linear import linear, pack
from services.rope import apply_rotary


@dataclass(slots=True)
class RaggedLayout:
    """Where each request's new tokens sit in the flattened batch and in the cache."""

    slots: list[int]  # [R] cache slot of each request
    starts: list[int]  # [R] tokens already cached = position of the request's first new token
    lens: list[int]  # [R] new tokens of each request; N = sum(lens)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, as the reference implementation does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    """`norm` is the q/k norm's class where the config has q/k norms; `scale` the softmax scale (None:
    1/sqrt(head_dim)). Gemma's layers pass their own (services/gemma.py)."""

    def __init__(self, cfg: ModelConfig, norm: type[nn.Module] = RMSNorm, scale: float | None = None):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = norm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = norm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm, self.scale = cfg.qk_norm, scale
        # Buffers, not parameters: outside the checkpoint, yet constants a compiled step can pre-pack.
        self.register_buffer("qkv_weight", None, persistent=False)  # [(H + 2 Hkv) Dh, d] once fused (`fuse`)
        self.register_buffer("qkv_bias", None, persistent=False)
        self.qkv_packed = None  # qkv_weight packed for oneDNN (services/packed_linear.py, CPU serving)

    def fuse(self) -> None:
        """One [q; k; v] weight for the step forward, the three projections' weights becoming views of it, so
        checkpoint names stay and a later in-place load or optimizer step updates both. Idempotent."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = fuse_rows(projs, "weight")
        self.qkv_bias = None if self.q_proj.bias is None else fuse_rows(projs, "bias")

    def pack_fused(self) -> int:
        """Pack the fused weight (services/packed_linear.py) → 1 if packed."""
        if self.qkv_weight is not None:
            self.qkv_packed = pack(self.qkv_weight)
        return int(self.qkv_packed is not None)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., d] → q [..., H, Dh], k, v [..., Hkv, Dh], before qk-norm and rotary."""
        lead = x.shape[:-1]
        if self.qkv_weight is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = linear(x, self.qkv_weight, self.qkv_bias, self.qkv_packed).split(
                (self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim), dim=-1)
        q = q.view(*lead, self.n_heads, self.head_dim)
        k = k.view(*lead, self.n_kv, self.head_dim)
        v = v.view(*lead, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,  # [N, d]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [N, 1, Dh]
        plan: AttentionPlan,
        k_cache: torch.Tensor,  # [S, Hkv, L, Dh] this layer's keys, all slots
        v_cache: torch.Tensor,  # [S, Hkv, L, Dh]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.project(x)  # [N, H, Dh], [N, Hkv, Dh] x2
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = attend(q, k, v, plan, k_cache, v_cache, self.scale)  # [N, H, Dh]
        return self.o_proj(out.reshape(n, self.n_heads * self.head_dim))

    def forward_dense(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                      mask: torch.Tensor | None = None) -> torch.Tensor:
        """Cache-free causal attention over whole sequences, x [B, T, d] (training and feature extraction);
        `mask` [T, T] bool (True = attend) replaces the causal one (a sliding window)."""
        b, t, _ = x.shape
        q, k, v = self.project(x)  # [B, T, H, Dh], [B, T, Hkv, Dh] x2
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           is_causal=mask is None, enable_gqa=True, scale=self.scale)  # [B, H, T, Dh]
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


def fuse_rows(owners, name: str) -> torch.Tensor:
    """One tensor of the owners' `name` ("weight" or "bias") stacked on dim 0, each owner's own parameter
    becoming a view of its rows."""
    parts = [getattr(o, name) for o in owners]
    fused = torch.cat([p.detach() for p in parts])  # [sum(out), ...]
    offset = 0
    for owner, part in zip(owners, parts, strict=True):
        setattr(owner, name, nn.Parameter(fused[offset : offset + part.shape[0]], requires_grad=part.requires_grad))
        offset += part.shape[0]
    return fused


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); act SiLU (SwiGLU), or Gemma's tanh GELU (GeGLU) where passed."""

    def __init__(self, cfg: ModelConfig, act: Callable[[torch.Tensor], torch.Tensor] = F.silu):
        super().__init__()
        self.act = act
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=cfg.mlp_bias)
        self.register_buffer("gate_up_weight", None, persistent=False)  # [2F, d] once fused: gate rows, up rows
        self.register_buffer("gate_up_bias", None, persistent=False)
        self.gate_up_packed = None

    def fuse(self) -> None:
        """One [gate; up] weight (see `Attention.fuse`)."""
        projs = (self.gate_proj, self.up_proj)
        self.gate_up_weight = fuse_rows(projs, "weight")
        self.gate_up_bias = None if self.gate_proj.bias is None else fuse_rows(projs, "bias")

    def pack_fused(self) -> int:
        if self.gate_up_weight is not None:
            self.gate_up_packed = pack(self.gate_up_weight)
        return int(self.gate_up_packed is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        gate, up = linear(x, self.gate_up_weight, self.gate_up_bias, self.gate_up_packed).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    sliding = False  # attends every cached position (Gemma's sliding layers: services/gemma.py)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, plan: AttentionPlan, k_cache, v_cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, plan, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_dense(self, x: torch.Tensor, rope, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn.forward_dense(self.input_layernorm(x), rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

"""Decoder building blocks: RMSNorm, GQA attention over a slot KV cache, SwiGLU MLP.

Module and parameter names follow Hugging Face Llama/Qwen so checkpoints load by name.
Attention is ragged: the new tokens of many requests arrive flattened as [N, ...] and each
request attends causally over its own cache slot only, so a position's output never depends
on what else shares the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.model_config import ModelConfig
from services.rope import apply_rotary


@dataclass(slots=True)
class RaggedLayout:
    """Where each request's new tokens sit in the flattened batch and in the cache."""

    slots: list[int]  # [R] cache slot of each request
    starts: list[int]  # [R] tokens already cached = position of the request's first new token
    lens: list[int]  # [R] new tokens of each request; N = sum(lens)
    # Attend one query row at a time over exactly its own prefix, the call plain decoding makes, so a
    # position's output does not depend on how many rows its request verifies (costs a call per row).
    row_invariant: bool = False


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
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(
        self,
        x: torch.Tensor,  # [N, d]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [N, 1, Dh]
        layout: RaggedLayout,
        k_cache: torch.Tensor,  # [S, Hkv, L, Dh] this layer's keys, all slots
        v_cache: torch.Tensor,  # [S, Hkv, L, Dh]
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.n_heads, self.head_dim)  # [N, H, Dh]
        k = self.k_proj(x).view(n, self.n_kv, self.head_dim)  # [N, Hkv, Dh]
        v = self.v_proj(x).view(n, self.n_kv, self.head_dim)  # [N, Hkv, Dh]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = torch.empty_like(q)  # [N, H, Dh]
        offset = 0
        for slot, start, length in zip(layout.slots, layout.starts, layout.lens, strict=True):
            rows = slice(offset, offset + length)
            end = start + length
            k_cache[slot, :, start:end] = k[rows].transpose(0, 1)
            v_cache[slot, :, start:end] = v[rows].transpose(0, 1)
            if layout.row_invariant:
                for i in range(offset, offset + length):
                    pos = start + i - offset + 1
                    out[i] = _attend(q[i, :, None], k_cache[slot, :, :pos], v_cache[slot, :, :pos])[0]
            else:
                out[rows] = _attend(q[rows].transpose(0, 1), k_cache[slot, :, :end], v_cache[slot, :, :end])
            offset += length
        return self.o_proj(out.reshape(n, self.n_heads * self.head_dim))


    def forward_dense(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Cache-free causal attention over whole sequences, x [B, T, d] (training and feature extraction)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)  # [B, T, H, Dh]
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim)  # [B, T, Hkv, Dh]
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim)  # [B, T, Hkv, Dh]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)  # [B, H, T, Dh]
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [H, n, Dh] (the last n positions) over k, v [Hkv, T, Dh] → [n, H, Dh]."""
    n, total = q.shape[1], k.shape[1]
    if n == 1:
        # CPU SDPA is ~2x slower in bf16 for one query row than for two; duplicating is bit-identical.
        qq = torch.cat([q, q], dim=1)[None]
        o = F.scaled_dot_product_attention(qq, k[None], v[None], enable_gqa=True)[0, :, :1]
    else:
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)  # [n, T]
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0]
    return o.transpose(0, 1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, layout, k_cache, v_cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, layout, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_dense(self, x: torch.Tensor, rope) -> torch.Tensor:
        x = x + self.self_attn.forward_dense(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))

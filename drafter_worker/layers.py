"""Drafter building blocks.

Block drafters (DFlash, DSpark): the target's tap features of the context are projected once,
ctx = RMSNorm(fc(concat taps)), and injected into every layer as extra keys and values through that
layer's own k/v projections. A block of γ slots attends bidirectionally to itself and to the context
positions strictly before its anchor.

Chain drafters (EAGLE-3, MTP): one causal layer over rows (feature or draft hidden of position j, embedding
of token j+1); the output at row j predicts token j+2 and is the next row's hidden when drafting on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.layers import MLP, RMSNorm, fuse_rows
from services.model_config import ModelConfig
from services.packed_linear import pack
from services.rope import apply_rotary

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [..., 1, Dh] gathered at the rows' positions


class ContextProjection(nn.Module):
    def __init__(self, cfg: ModelConfig, num_taps: int, norm: bool = True):
        super().__init__()
        self.fc = nn.Linear(num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if norm else nn.Identity()

    def forward(self, taps: torch.Tensor) -> torch.Tensor:  # [..., T*d] → [..., d]
        return self.hidden_norm(self.fc(taps))


class DraftAttention(nn.Module):
    """GQA attention whose keys and values are given from outside: injected context or a row cache."""

    def __init__(self, cfg: ModelConfig, in_dim: int | None = None):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d_in = in_dim or cfg.hidden_size
        self.q_proj = nn.Linear(d_in, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d_in, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d_in, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = None  # the softmax scale is head_dim^−½, as services.layers.Attention's default
        # As services.layers.Attention: one [q; k; v] weight (`fuse`), which the fused block path runs.
        self.register_buffer("qkv_weight", None, persistent=False)  # [(H + 2 Hkv) Dh, d_in]
        self.register_buffer("qkv_bias", None, persistent=False)
        self.qkv_packed = self.kv_packed = None
        self.kv_weight = self.kv_bias = None  # its [k; v] rows: what injected context rows need

    def fuse(self) -> None:
        """The three projections' weights become views of one [q; k; v] weight (names unchanged). Idempotent."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = fuse_rows(projs, "weight")
        self.qkv_bias = None if self.q_proj.bias is None else fuse_rows(projs, "bias")
        q_width = self.n_heads * self.head_dim
        self.kv_weight = self.qkv_weight[q_width:]
        self.kv_bias = None if self.qkv_bias is None else self.qkv_bias[q_width:]

    def pack_fused(self) -> int:
        if self.qkv_weight is not None:
            self.qkv_packed, self.kv_packed = pack(self.qkv_weight), pack(self.kv_weight)
        return int(self.qkv_packed is not None)

    def keys_values(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., N, d_in] → k, v [..., Hkv, N, Dh], k rotated to the rows' positions."""
        k = self.k_proj(x).unflatten(-1, (self.n_kv, self.head_dim))  # [..., N, Hkv, Dh]
        v = self.v_proj(x).unflatten(-1, (self.n_kv, self.head_dim))
        if self.qk_norm:
            k = self.k_norm(k)
        return apply_rotary(k, *rope).transpose(-2, -3), v.transpose(-2, -3)

    def queries(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """x [..., N, d_in] → q [..., H, N, Dh]."""
        q = self.q_proj(x).unflatten(-1, (self.n_heads, self.head_dim))
        if self.qk_norm:
            q = self.q_norm(q)
        return apply_rotary(q, *rope).transpose(-2, -3)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [B, H, n, Dh] over k, v [B, Hkv, m, Dh] with mask [B, 1|H, n, m] (True = attend) → [B, n, d]."""
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # [B, H, n, Dh]
        return self.o_proj(o.transpose(1, 2).flatten(2))


class BlockLayer(nn.Module):
    """Pre-norm layer whose block queries see [context K/V ; block K/V]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,  # [G, n, d] block hidden states: G groups of n rows (a block of γ, or a sequence's blocks)
        rope: Rope,  # [G, n, 1, Dh] at the rows' positions
        ctx_k: torch.Tensor,  # [G | 1, Hkv, S, Dh] injected context keys (this layer's projection)
        ctx_v: torch.Tensor,  # [G | 1, Hkv, S, Dh]
        mask: torch.Tensor,  # [G, 1, n | 1, S + n] bool, True where a row may see a context position or row
    ) -> torch.Tensor:
        g = x.shape[0]
        h = self.input_layernorm(x)
        q = self.self_attn.queries(h, rope)  # [G, H, n, Dh]
        k, v = self.self_attn.keys_values(h, rope)  # [G, Hkv, n, Dh]
        k = torch.cat([ctx_k.expand(g, -1, -1, -1), k], dim=2)  # [G, Hkv, S+n, Dh]
        v = torch.cat([ctx_v.expand(g, -1, -1, -1), v], dim=2)
        x = x + self.self_attn.attend(q, k, v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class ChainLayer(nn.Module):
    """EAGLE-3: attention over [RMSNorm(emb); RMSNorm(hidden)] (2d wide), residual on the hidden.
    MTP: proj([RMSNorm(hidden); RMSNorm(emb)]) → an ordinary pre-norm decoder layer."""

    def __init__(self, cfg: ModelConfig, mtp: bool, norm_before_residual: bool = False):
        super().__init__()
        d = cfg.hidden_size
        self.mtp, self.norm_before_residual = mtp, norm_before_residual
        self.embed_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        if mtp:
            self.proj = nn.Linear(2 * d, d, bias=False)
            self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, in_dim=d if mtp else 2 * d)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def inputs(self, emb: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual [..., d], attention input [..., d_in]) of rows (hidden_j, emb(token_{j+1}))."""
        if self.mtp:
            x = self.proj(torch.cat([self.hidden_norm(hidden), self.embed_norm(emb)], dim=-1))
            return x, self.input_layernorm(x)
        normed = self.hidden_norm(hidden)
        return normed if self.norm_before_residual else hidden, torch.cat([self.embed_norm(emb), normed], dim=-1)

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        x = residual + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))

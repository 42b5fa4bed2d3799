"""Gemma 3 decoder pieces: (1 + w) RMSNorm, the four-norm layer with GeGLU, embedding scale, logit softcap.

What a Gemma 3 text decoder (HF `Gemma3ForCausalLM`) computes beyond a Llama one, as HF's modeling_gemma3
does it: embeddings times sqrt(d) rounded to the embedding dtype; every norm zero-centred (weight 0 is the
identity) and applied in fp32 before the cast; attention and MLP outputs normed again before their residual
add; q/k norms; softmax scale 1/sqrt(query_pre_attn_scalar); tanh-GELU gating; sliding-window layers with
their own RoPE base (the window itself is cut from the step's causal mask: `AttentionPlan.windowed`).
Parameter names are HF's, so checkpoints load by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.attention import AttentionPlan
from services.layers import MLP, Attention, DecoderLayer, RMSNorm
from services.model_config import ModelConfig


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + w): HF multiplies in fp32 and casts after, where Llama casts before the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")  # HF's gelu_pytorch_tanh


class GemmaDecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x))) (HF's order)."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        spec = cfg.gemma
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.sliding = spec.sliding_layers[index]
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.self_attn = Attention(cfg, norm=GemmaRMSNorm, scale=spec.query_pre_attn_scalar ** -0.5)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.mlp = MLP(cfg, act=gelu_tanh)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)

    def forward(self, x, rope, plan: AttentionPlan, k_cache, v_cache) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, plan, k_cache, v_cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def forward_dense(self, x: torch.Tensor, rope, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn.forward_dense(self.input_layernorm(x), rope, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def decoder_layer(cfg: ModelConfig, index: int) -> nn.Module:
    return DecoderLayer(cfg) if cfg.gemma is None else GemmaDecoderLayer(cfg, index)


def final_norm(cfg: ModelConfig) -> nn.Module:
    return (RMSNorm if cfg.gemma is None else GemmaRMSNorm)(cfg.hidden_size, cfg.rms_norm_eps)


def scale_embeddings(x: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """x [..., d] times sqrt(d) as HF does it: the factor made fp32, then rounded to x's dtype (55.4256
    becomes 55.5 in bf16), so bf16 embeddings match HF's bits."""
    return x * torch.tensor(hidden_size**0.5, dtype=torch.float32, device=x.device).to(x.dtype)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap) in the logits' dtype (HF's final_logit_softcapping); unchanged without a cap."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def dense_window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """[T, T] bool: row p attends keys in (p - window, p], the sliding layers' mask of a cache-free forward."""
    pos = torch.arange(length, device=device)
    offset = pos[:, None] - pos[None, :]  # [T, T] query position minus key position
    return (offset >= 0) & (offset < window)

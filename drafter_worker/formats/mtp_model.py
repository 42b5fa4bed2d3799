"""A released MTP module (DeepSeek-V3 `model.layers.{L}`, Qwen3-Next `mtp.*`) as a dspark chain drafter.

Row j pairs the target's final hidden state h_j (the final-hidden tap, `services/model.py`) with the embedding
of token j + 1, at RoPE position j, and predicts token j + 2 (dspark's chain layout, `chain_model.py`):

    x   = eh_proj([enorm(emb(token_{j+1})); hnorm(h_j)])        embedding first, as both formats store it
    x   = x + attn(input_layernorm(x))                          MLA (DeepSeek) or gated attention (Qwen3-Next)
    x   = x + moe(post_attention_layernorm(x))
    out = x (DeepSeek; logits = head(norm(x)))  |  norm(x) (Qwen3-Next; logits = head(out))

`out` is also the hidden of the next draft row when drafting on (γ > 1): vLLM feeds back what each module's
forward returns, which is pre-norm for DeepSeek's and post-norm for Qwen3-Next's. DeepSeek's module zeroes the
embedding of the row at position 0 (vLLM `deepseek_mtp.py`). The interface is `ChainDraftModel`'s, so the
`Drafter` runs it unchanged; `project` returns a `Rows` (the residual and the attention gate) where the chain
model returns its residual: the `Drafter` only hands it back to `finish`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from drafter_worker.config import DrafterConfig
from drafter_worker.formats.mtp_layers import GatedAttention, GatedDims, MlaAttention, MlaDims, PairRope
from drafter_worker.formats.mtp_moe import DeepseekMoE, MoeDims, QwenNextMoE
from services.layers import RMSNorm
from services.model_config import RopeConfig
from services.rope import RotaryTable


@dataclass(frozen=True, slots=True)
class MtpConfig:
    kind: str  # "deepseek_mtp" | "qwen3_next_mtp"
    vocab_size: int
    hidden_size: int
    rms_norm_eps: float
    attention: MlaDims | GatedDims
    moe: MoeDims
    max_position_embeddings: int  # the RoPE table: the target's context
    target_layers: int  # the main model's decoder layers (the module's index in DeepSeek's names)

    @property
    def max_context(self) -> int:
        return self.max_position_embeddings

    @property
    def deepseek(self) -> bool:
        return self.kind == "deepseek_mtp"


@dataclass(slots=True)
class Rows:
    """What `finish` needs of projected rows besides q/k/v."""

    residual: torch.Tensor  # [..., n, d]
    gate: torch.Tensor | None  # [..., n, H·Dh] Qwen3-Next's output gate


class MtpLayer(nn.Module):
    def __init__(self, cfg: MtpConfig):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        if cfg.deepseek:
            self.self_attn = MlaAttention(d, cfg.attention)
            self.mlp = DeepseekMoE(d, cfg.moe)
        else:
            self.self_attn = GatedAttention(d, cfg.attention)
            self.mlp = QwenNextMoE(d, cfg.moe)


class MtpDraftModel(nn.Module):
    def __init__(self, dcfg: DrafterConfig, cfg: MtpConfig):
        super().__init__()
        d = cfg.hidden_size
        self.dconfig, self.config = dcfg, cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)  # the target's (or the module's own copy)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.context = nn.Identity()  # the only tap is the target's final hidden: no fusion
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)  # input [enorm(emb); hnorm(hidden)]
        self.layer = MtpLayer(cfg)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self._rope = None

    reduced_vocab = False  # the target's full vocabulary: its ids are the target's (`DraftModelBase.to_target`)

    @staticmethod
    def to_target(ids: torch.Tensor) -> torch.Tensor:
        return ids

    draft_ids = scatter_vocab = to_target

    @property
    def feature_width(self) -> int:
        return self.config.hidden_size

    def rope(self):
        """DeepSeek: `PairRope` (interleaved, YaRN); Qwen3-Next: a rotate-half table of rotary_dim."""
        device = self.lm_head.weight.device
        if self._rope is None or self._rope.cos.device != device:
            a, n = self.config.attention, self.config.max_position_embeddings
            self._rope = PairRope(a.theta, a.rope, a.yarn, n, device) if self.config.deepseek else \
                RotaryTable(RopeConfig(theta=a.theta), a.rotary_dim, n, device)
        return self._rope

    def project(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor):
        """Rows (hidden [..., n, d], token_{j+1} [..., n]) at positions [..., n] → Rows, q, k, v (the
        attention's layout: `mtp_layers.py`)."""
        emb = self.embed_tokens(next_tokens)
        if self.config.deepseek:  # vLLM: "masking inputs at position 0, as not needed by MTP"
            emb = emb * (positions != 0)[..., None].to(emb.dtype)
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))  # [..., n, d]
        rope = self.rope()
        if not self.config.deepseek:
            rope = rope.gather(positions, x.dtype)  # cos, sin [..., n, 1, rotary_dim]
        q, k, v, gate = self.layer.self_attn.project(self.layer.input_layernorm(x), positions, rope)
        return Rows(x, gate), q, k, v

    def finish(self, rows: Rows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Attend q [B, H, n, ·] over the rows' k, v (mask [B, 1, n, m]) → row outputs [B, n, d]."""
        x = rows.residual + self.layer.self_attn.attend(q, k, v, mask, rows.gate)
        x = x + self.layer.mlp(self.layer.post_attention_layernorm(x))
        return x if self.config.deepseek else self.norm(x)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out) if self.config.deepseek else out)

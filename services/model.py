"""Llama-family causal LM with a ragged, cache-backed forward and feature taps."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from services.attention import AttentionPlan
from services.layers import DecoderLayer, RaggedLayout, RMSNorm
from services.model_config import ModelConfig
from services.rope import RotaryTable


@dataclass(slots=True)
class ForwardOutput:
    logits: torch.Tensor  # [M, V] fp32, for the requested rows only
    features: torch.Tensor | None  # [N, num_taps * d] hidden states after the tap layers, model dtype
    hidden: torch.Tensor | None = None  # [B, T, d] final normed hidden state (forward_dense only)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Target model. `tap_layers` are decoder-layer indices (0-based) whose outputs are features; tap L (the
    layer count) is the final hidden state *after* the final norm, the one the LM head reads: what vLLM's and
    SGLang's target forward returns and feeds released MTP modules (`drafter_worker/formats/mtp.py`). Features
    are concatenated in layer order, so tap L comes last."""

    def __init__(self, cfg: ModelConfig, tap_layers: tuple[int, ...] = ()):
        super().__init__()
        for tap in tap_layers:
            if not 0 <= tap <= cfg.num_hidden_layers:
                raise ValueError(f"tap layer {tap} outside 0..{cfg.num_hidden_layers} (L: the final normed hidden)")
        self.config = cfg
        self.tap_layers = tuple(tap_layers)
        self.final_tap = cfg.num_hidden_layers in self.tap_layers
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rotary: RotaryTable | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def rotary(self) -> RotaryTable:
        if self._rotary is None or self._rotary.cos.device != self.device:
            cfg = self.config
            self._rotary = RotaryTable(cfg.rope, cfg.head_dim, cfg.max_context, self.device)
        return self._rotary

    def forward(
        self,
        input_ids: torch.Tensor,  # [N] int64, new tokens of all requests, flattened
        positions: torch.Tensor,  # [N] int64
        layout: RaggedLayout,
        k_cache: torch.Tensor,  # [num_layers, S, Hkv, L, Dh]
        v_cache: torch.Tensor,  # [num_layers, S, Hkv, L, Dh]
        logit_rows: torch.Tensor,  # [M] int64, rows of N whose next-token logits are wanted
    ) -> ForwardOutput:
        plan = AttentionPlan.build(layout.slots, layout.starts, layout.lens, input_ids.device, k_cache[0].shape[2])
        logits, features = self.step(input_ids, positions, *plan.tensors(), k_cache, v_cache, logit_rows)
        return ForwardOutput(logits=logits, features=features)

    def step(self, input_ids, positions, write_slots, write_pos, block_slots, gather_rows, mask, scatter,
             k_cache, v_cache, logit_rows) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward on tensors only (an `AttentionPlan`'s, in field order): what `torch.compile` traces."""
        plan = AttentionPlan(write_slots, write_pos, block_slots, gather_rows, mask, scatter)
        x = self.model.embed_tokens(input_ids)  # [N, d]
        rope = self.rotary().gather(positions, x.dtype)
        taps = []
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rope, plan, k_cache[i], v_cache[i])
            if i in self.tap_layers:
                taps.append(x)
        if self.final_tap:  # every row's normed hidden is a feature; the logit rows are some of them
            taps.append(self.model.norm(x))  # [N, d]
            h = taps[-1][logit_rows]
        else:
            h = self.model.norm(x[logit_rows])  # [M, d]
        logits = self.lm_head(h).float()  # [M, V]
        features = torch.cat(taps, dim=-1) if taps else None  # [N, T*d]
        return logits, features

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up into one GEMM each for serving (names and checkpoints unchanged)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def forward_dense(self, input_ids: torch.Tensor) -> ForwardOutput:
        """Whole sequences without a cache, input_ids [B, T] → logits [B, T, V] (model dtype, or the autocast
        dtype) and features [B, T, num_taps * d]: for training and for extracting target features."""
        x = self.model.embed_tokens(input_ids)  # [B, T, d]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        rope = self.rotary().gather(positions, x.dtype)  # cos, sin [T, 1, Dh]
        taps = []
        for i, layer in enumerate(self.model.layers):
            x = layer.forward_dense(x, rope)
            if i in self.tap_layers:
                taps.append(x)
        hidden = self.model.norm(x)  # [B, T, d]
        if self.final_tap:
            taps.append(hidden)
        return ForwardOutput(logits=self.lm_head(hidden), features=torch.cat(taps, dim=-1) if taps else None,
                             hidden=hidden)

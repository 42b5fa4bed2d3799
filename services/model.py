"""Llama-family (and Gemma 3) causal LM with a ragged, cache-backed forward and feature taps."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from services import fused_decoder
from services.attention import AttentionPlan
from services.gemma import decoder_layer, dense_window_mask, final_norm, scale_embeddings, softcap
from services.layers import RaggedLayout
from services.model_config import ModelConfig
from services.packed_linear import pack_linears
from services.rope import RotaryTable


@dataclass(slots=True)
class ForwardOutput:
    logits: torch.Tensor | None  # [M, V] fp32, for the requested rows only
    features: torch.Tensor | None  # [N, num_taps * d] hidden states after the tap layers, model dtype
    hidden: torch.Tensor | None = None  # [B, T, d] final normed hidden state (forward_dense only)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(decoder_layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = final_norm(cfg)


class CausalLM(nn.Module):
    """Target model. `tap_layers` are decoder-layer indices (0-based) whose outputs are features; tap L (the
    layer count) is the final hidden state *after* the final norm, the one the LM head reads: what vLLM's and
    SGLang's target forward returns and feeds released MTP modules (`drafter_worker/formats/mtp.py`). Features
    are concatenated in layer order, so tap L comes last.

    Gemma 3 (`cfg.gemma`): embeddings are scaled after the lookup, so `model.embed_tokens.weight`, the one
    drafters share, is the checkpoint's as-is (vLLM shares it so too); sliding layers read their own RoPE
    table and a windowed attention plan."""

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
        self._local_rotary: RotaryTable | None = None  # Gemma's sliding layers' (`rope_local_base_freq`)
        self.fused = False  # steps run each layer as one kernel call (services/fused_decoder.py; set when prepared)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def rotary(self) -> RotaryTable:
        """The (global layers') table; builds the sliding layers' one with it, so a compiled step finds both."""
        if self._rotary is None or self._rotary.cos.device != self.device:
            cfg = self.config
            self._rotary = RotaryTable(cfg.rope, cfg.head_dim, cfg.max_context, self.device)
            if cfg.gemma is not None:
                self._local_rotary = RotaryTable(cfg.gemma.local_rope, cfg.head_dim, cfg.max_context, self.device)
        return self._rotary

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [..., d]
        return x if self.config.gemma is None else scale_embeddings(x, self.config.hidden_size)

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(h)  # [..., V] model dtype
        return logits if self.config.gemma is None else softcap(logits, self.config.gemma.final_logit_softcapping)

    def _layer_inputs(self, positions: torch.Tensor, dtype: torch.dtype, attn) -> dict[bool, tuple]:
        """(rope, attention) for each kind of layer, keyed by `layer.sliding`: the step's plan (or a dense
        forward's mask, None = causal) for global layers, the windowed one and the local RoPE for sliding."""
        inputs = {False: (self.rotary().gather(positions, dtype), attn)}
        spec = self.config.gemma
        if spec is not None and any(spec.sliding_layers):
            window = spec.sliding_window
            local = (attn.windowed(window) if isinstance(attn, AttentionPlan)
                     else dense_window_mask(positions.shape[0], window, positions.device))
            inputs[True] = (self._local_rotary.gather(positions, dtype), local)
        return inputs

    def forward(
        self,
        input_ids: torch.Tensor,  # [N] int64, new tokens of all requests, flattened
        positions: torch.Tensor,  # [N] int64
        layout: RaggedLayout,
        k_cache: torch.Tensor,  # [num_layers, S, Hkv, L, Dh]
        v_cache: torch.Tensor,  # [num_layers, S, Hkv, L, Dh]
        logit_rows: torch.Tensor,  # [M] int64, rows of N whose next-token logits are wanted
    ) -> ForwardOutput:
        if self.fused and not torch.compiler.is_compiling():
            logits, features = self._run_fused(input_ids, positions, layout, k_cache, v_cache, logit_rows)
            return ForwardOutput(logits=logits, features=features)
        plan = AttentionPlan.build(layout.slots, layout.starts, layout.lens, input_ids.device, k_cache[0].shape[2])
        logits, features = self._run(input_ids, positions, plan, k_cache, v_cache, logit_rows)
        return ForwardOutput(logits=logits, features=features)

    def _run_fused(self, input_ids, positions, layout: RaggedLayout, k_cache, v_cache, logit_rows):
        """`_run` with every layer one kernel call: no attention plan, rotary read in fp32."""
        dev = input_ids.device
        slots = torch.tensor(layout.slots, device=dev).repeat_interleave(torch.tensor(layout.lens, device=dev))  # [N]
        table = self.rotary()
        cos, sin = table.cos[positions], table.sin[positions]  # [N, Dh] fp32
        x = self._embed(input_ids)  # [N, d]
        taps = []
        for i, layer in enumerate(self.model.layers):
            x = fused_decoder.run_layer(layer, x, cos, sin, k_cache[i], v_cache[i], slots, positions)
            if i in self.tap_layers:
                taps.append(x)
        return self._outputs(x, taps, logit_rows)

    def step(self, input_ids, positions, write_slots, write_pos, block_slots, gather_rows, mask, scatter,
             k_cache, v_cache, logit_rows) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward on tensors only (an `AttentionPlan`'s of one block size, in field order): what
        `torch.compile` traces."""
        plan = AttentionPlan(write_slots, write_pos, block_slots, gather_rows, mask, scatter)
        return self._run(input_ids, positions, plan, k_cache, v_cache, logit_rows)

    def _run(self, input_ids, positions, plan: AttentionPlan, k_cache, v_cache, logit_rows):
        x = self._embed(input_ids)  # [N, d]
        inputs = self._layer_inputs(positions, x.dtype, plan)  # cos, sin [N, 1, Dh] and a plan per layer kind
        taps = []
        for i, layer in enumerate(self.model.layers):
            rope, layer_plan = inputs[layer.sliding]
            x = layer(x, rope, layer_plan, k_cache[i], v_cache[i])
            if i in self.tap_layers:
                taps.append(x)
        return self._outputs(x, taps, logit_rows)

    def _outputs(self, x: torch.Tensor, taps: list[torch.Tensor], logit_rows: torch.Tensor):
        """The last layer's output x [N, d] and the tap layers' → logits [M, V] fp32, features [N, T*d] or None."""
        if self.final_tap:  # every row's normed hidden is a feature; the logit rows are some of them
            taps.append(self.model.norm(x))  # [N, d]
            h = taps[-1][logit_rows]
        else:
            h = self.model.norm(x[logit_rows])  # [M, d]
        logits = self.head_logits(h).float()  # [M, V]
        features = torch.cat(taps, dim=-1) if taps else None  # [N, T*d]
        return logits, features

    def prepare_for_serving(self) -> None:
        """Fuse q/k/v and gate/up into one GEMM each and, on the CPU, pack every linear for oneDNN
        (services/packed_linear.py) and run each layer as one kernel call where the kernel serves the model
        (services/fused_decoder.py); names and checkpoints unchanged. Idempotent."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        pack_linears(self)
        self.fused = fused_decoder.serves(self)

    def forward_dense(self, input_ids: torch.Tensor, head: bool = True) -> ForwardOutput:
        """Whole sequences without a cache, input_ids [B, T] → logits [B, T, V] (model dtype, or the autocast
        dtype; None with `head` off) and features [B, T, num_taps * d]: for training and for extracting target
        features."""
        x = self._embed(input_ids)  # [B, T, d]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        inputs = self._layer_inputs(positions, x.dtype, None)  # cos, sin [T, 1, Dh] and a [T, T] mask or None
        taps = []
        for i, layer in enumerate(self.model.layers):
            x = layer.forward_dense(x, *inputs[layer.sliding])
            if i in self.tap_layers:
                taps.append(x)
        hidden = self.model.norm(x)  # [B, T, d]
        if self.final_tap:
            taps.append(hidden)
        return ForwardOutput(logits=self.head_logits(hidden) if head else None,
                             features=torch.cat(taps, dim=-1) if taps else None, hidden=hidden)

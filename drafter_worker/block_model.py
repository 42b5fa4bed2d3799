"""DFlash and DSpark draft models: one parallel forward over [anchor, MASK × (γ−1)].

Slot k (0-based) at position anchor_pos + k predicts the token at anchor_pos + k + 1 (shifted layout: the
anchor slot predicts the first draft). The fill-in layout of z-lab's DFlash runs [anchor, MASK × γ] instead
and takes slots 1..γ, each predicting its own position; the rest is the same. The block attends to the
injected context of positions strictly before the anchor, whose target features exist, and bidirectionally
to itself.
"""

from __future__ import annotations

import torch
from torch import nn

from drafter_worker.base import DraftModelBase
from drafter_worker.config import DrafterConfig
from drafter_worker.heads import ConfidenceHead, SequentialHead
from drafter_worker.layers import BlockLayer, ContextProjection
from services.layers import RMSNorm
from services.model_config import ModelConfig

ContextKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v) [B, Hkv, S, Dh]


class BlockDraftModel(DraftModelBase):
    def __init__(self, dcfg: DrafterConfig, cfg: ModelConfig, embed: torch.Tensor):
        super().__init__(dcfg, cfg, embed)
        self.context = ContextProjection(cfg, len(dcfg.tap_layers))
        self.layers = nn.ModuleList(BlockLayer(cfg) for _ in range(dcfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.seq_head = None
        if dcfg.head is not None:
            self.seq_head = SequentialHead(dcfg.head, self.draft_vocab, cfg.hidden_size, dcfg.markov_rank,
                                           other_row=self.reduced_vocab)
        self.confidence = ConfidenceHead(cfg.hidden_size, dcfg.markov_rank) if dcfg.confidence_head else None

    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """Target features taps [B, S, T*d] at positions [B, S] → each layer's context (k, v) [B, Hkv, S, Dh]."""
        return self.rows_kv(self.context(taps), positions)

    def rows_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """Context rows ctx [B, S, d] (projected target features, or the drafter's own states standing in for
        them) at positions [B, S] → each layer's (k, v) [B, Hkv, S, Dh]."""
        rope = self.rotary().gather(positions, ctx.dtype)
        return [layer.self_attn.keys_values(ctx, rope) for layer in self.layers]

    def backbone(
        self,
        anchors: torch.Tensor,  # [A] int64 anchor tokens
        anchor_pos: torch.Tensor,  # [A] int64 anchor positions
        ctx_kv: ContextKV,  # per layer [A | 1, Hkv, S, Dh]
        ctx_mask: torch.Tensor,  # [A, S] bool, context positions visible to each block (< anchor)
        gamma: int,
    ) -> torch.Tensor:
        """→ h [A, γ, d], the final-normed state of every slot that predicts a draft."""
        x, rope = self._block_inputs(anchors, anchor_pos, gamma)  # [A, γ', d]
        block = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)  # bidirectional inside the block
        mask = torch.cat([ctx_mask, block], dim=1)[:, None, None, :]  # [A, 1, 1, S+γ']
        for layer, (k, v) in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, rope, k, v, mask)
        return self.final(x)

    def backbone_packed(
        self,
        anchors: torch.Tensor,  # [A] int64 anchor tokens
        anchor_pos: torch.Tensor,  # [A] int64 anchor positions
        seq: torch.Tensor,  # [A] int64 sequence of each anchor, ascending
        ctx_kv: ContextKV,  # per layer [B, Hkv, S, Dh], one context per sequence
        gamma: int,
    ) -> torch.Tensor:
        """`backbone` for training: the blocks of one sequence are the rows of one attention problem over that
        sequence's context (a block sees the context before its anchor and itself), so the context keys are
        not copied per anchor and their gradients are not scattered back per anchor. Same h [A, γ, d]."""
        b, s = ctx_kv[0][0].shape[0], ctx_kv[0][0].shape[2]
        x, rope = self._block_inputs(anchors, anchor_pos, gamma)  # [A, γ', d]
        width = x.shape[1]
        counts = torch.bincount(seq, minlength=b)  # [B] blocks of each sequence
        first = torch.cumsum(counts, 0) - counts  # [B] index of each sequence's first block
        rank = torch.arange(len(seq), device=seq.device) - first[seq]  # [A] place of a block in its sequence
        per = int(counts.max())
        place = seq * per + rank  # [A] slot in the padded [B, per] layout
        rows = x.new_zeros(b * per, width, x.shape[2]).index_copy(0, place, x).view(b, per * width, -1)
        cos, sin = (t.new_zeros(b * per, *t.shape[1:]).index_copy(0, place, t) for t in rope)
        rope = (cos.view(b, per * width, *cos.shape[2:]), sin.view(b, per * width, *sin.shape[2:]))
        pos = torch.full((b * per,), -1, dtype=torch.long, device=x.device).index_copy(0, place, anchor_pos)
        ctx = torch.arange(s, device=x.device) < pos.view(b, per, 1)  # [B, per, S] (padding blocks: nothing)
        block_id = torch.arange(per, device=x.device).repeat_interleave(width)  # [per·γ'] block of each row
        own = block_id[:, None] == block_id[None, :]  # [per·γ', per·γ'] a row sees its own block
        mask = torch.cat([ctx.repeat_interleave(width, dim=1), own.expand(b, -1, -1)], dim=2)[:, None]
        for layer, (k, v) in zip(self.layers, ctx_kv, strict=True):
            rows = layer(rows, rope, k, v, mask)  # [B, per·γ', d]
        return self.final(rows.view(b * per, width, -1)[place])

    def _block_inputs(self, anchors: torch.Tensor, anchor_pos: torch.Tensor, gamma: int):
        """→ x [A, γ', d] embeddings of [anchor, MASK, ..., MASK] and their rope (γ' = γ, or γ + 1 for fill-in)."""
        gamma += self.dconfig.layout == "fill_in"  # fill-in: the anchor's slot predicts nothing
        slots = torch.full((anchors.shape[0], gamma), self.dconfig.mask_token_id, dtype=torch.long,
                           device=anchors.device)
        slots[:, 0] = anchors  # [A, γ']
        positions = anchor_pos[:, None] + torch.arange(gamma, device=anchors.device)  # [A, γ']
        x = self.embed_tokens(slots)  # [A, γ', d]
        return x, self.rotary().gather(positions, x.dtype)  # rope [A, γ', 1, Dh]

    def final(self, x: torch.Tensor) -> torch.Tensor:
        """The rows [A, γ', d] of blocks → the final-normed states of the slots that predict drafts [A, γ, d]."""
        return self.norm(x[:, 1:] if self.dconfig.layout == "fill_in" else x)

    def block_start(self, anchors: torch.Tensor, anchor_pos: torch.Tensor, ctx_kv: ContextKV, ctx_mask: torch.Tensor,
                    gamma: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The parallel part of drafting a block → h [A, γ, d], U [A, γ, Vd] fp32, the head's first state."""
        return self.heads_start(self.backbone(anchors, anchor_pos, ctx_kv, ctx_mask, gamma))

    def heads_start(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Backbone states h [A, γ, d] → h, U [A, γ, Vd] fp32, the head's first state."""
        state = None if self.seq_head is None else self.seq_head.init_state(h.shape[0], h[:, 0])
        return h, self.lm_head(h).float(), state

    def head_step(self, base_k: torch.Tensor, h_k: torch.Tensor, prev: torch.Tensor, state: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Sequential step k: U_k [A, Vd], h_k [A, d], x_{k−1} [A] (target ids) → logits U_k + B_k [A, Vd] fp32,
        confidence logit [A] (None without the head), next state."""
        if self.seq_head is None:
            return base_k, None, state
        bias, prev_embed, state = self.seq_head.step(self.draft_ids(prev), h_k, state)
        conf = None if self.confidence is None else self.confidence(h_k, prev_embed).float()
        return base_k + bias.float(), conf, state

    def draft_greedy(self, anchors: torch.Tensor, anchor_pos: torch.Tensor, ctx_kv: ContextKV, ctx_mask: torch.Tensor,
                     gamma: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A whole greedy block on tensors only (what a compiled drafter traces), each step taking the argmax
        of U_k + B_k → tokens [A, γ] (target ids), peaks max_v q [A, γ], confidence logits [A, γ] (None without
        the head)."""
        return self.greedy_heads(self.backbone(anchors, anchor_pos, ctx_kv, ctx_mask, gamma), anchors)

    def greedy_heads(self, h: torch.Tensor, anchors: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`draft_greedy` from the backbone's states h [A, γ, d] on."""
        h, base, state = self.heads_start(h)
        if self.seq_head is None:  # DFlash: no step depends on the one before
            peaks, tokens = base.softmax(-1).max(-1)  # [A, γ]
            return self.to_target(tokens), peaks, None
        prev, tokens, peaks, conf = anchors, [], [], []
        gamma = h.shape[1]
        for k in range(gamma):
            logits, z, state = self.head_step(base[:, k], h[:, k], prev, state)
            if z is not None:
                conf.append(z)
            peak, pick = logits.softmax(-1).max(-1)  # [A], [A]
            prev = self.to_target(pick)
            tokens.append(prev)
            peaks.append(peak)
        return torch.stack(tokens, 1), torch.stack(peaks, 1), torch.stack(conf, 1) if conf else None

    def teacher_forced(self, h: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Training: h [A, γ, d], ground-truth previous tokens prev [A, γ] (target ids, anchor first) →
        draft logits U + B [A, γ, Vd] and confidence logits [A, γ] (None without the head)."""
        logits = self.lm_head(h)  # U [A, γ, Vd]
        if self.seq_head is None:
            return logits, None
        bias, prev_embed = self.seq_head.teacher_forced(self.draft_ids(prev), h)
        conf = self.confidence(h, prev_embed) if self.confidence is not None else None
        return logits + bias, conf

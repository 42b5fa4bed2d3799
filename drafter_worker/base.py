"""What every draft model has: the target's embedding and LM head (frozen copies) and a RoPE table.

With a reduced draft vocabulary (`DrafterConfig.draft_vocab_size`, EAGLE-3's d2t) the LM head is the
drafter's own [Vd, d] and `vocab_logits` scatters its logits to target ids, −inf elsewhere: q is then a
distribution over the target vocabulary that is 0 outside the draft vocabulary, and verification against
it stays exact."""

from __future__ import annotations

import torch
from torch import nn

from drafter_worker.config import DrafterConfig
from services.model_config import ModelConfig
from services.rope import RotaryTable


class DraftModelBase(nn.Module):
    def __init__(self, dcfg: DrafterConfig, cfg: ModelConfig):
        super().__init__()
        self.dconfig, self.config = dcfg, cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # the target's, frozen
        vd = dcfg.draft_vocab_size
        self.lm_head = nn.Linear(cfg.hidden_size, vd or cfg.vocab_size, bias=False)  # the target's, or own [Vd, d]
        if vd is not None:
            self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))  # [Vd] target id − draft id
        self._rotary: RotaryTable | None = None

    @property
    def feature_width(self) -> int:
        """Width of the target features it reads: num_taps · d."""
        return self.context.fc.in_features

    @property
    def reduced_vocab(self) -> bool:
        return self.dconfig.draft_vocab_size is not None

    def vocab_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] → logits over the target vocabulary [..., V]."""
        logits = self.lm_head(x)
        if not self.reduced_vocab:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., torch.arange(len(self.d2t), device=x.device) + self.d2t] = logits
        return full

    def rotary(self) -> RotaryTable:
        device = self.lm_head.weight.device
        if self._rotary is None or self._rotary.cos.device != device:
            self._rotary = RotaryTable(self.config.rope, self.config.head_dim, self.config.max_context, device)
        return self._rotary

"""What every draft model has: the target's embedding and LM head (frozen copies) and a RoPE table."""

from __future__ import annotations

from torch import nn

from drafter_worker.config import DrafterConfig
from services.model_config import ModelConfig
from services.rope import RotaryTable


class DraftModelBase(nn.Module):
    def __init__(self, dcfg: DrafterConfig, cfg: ModelConfig):
        super().__init__()
        self.dconfig, self.config = dcfg, cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # the target's, frozen
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # the target's, frozen
        self._rotary: RotaryTable | None = None

    def rotary(self) -> RotaryTable:
        device = self.lm_head.weight.device
        if self._rotary is None or self._rotary.cos.device != device:
            self._rotary = RotaryTable(self.config.rope, self.config.head_dim, self.config.max_context, device)
        return self._rotary

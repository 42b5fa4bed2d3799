"""What every draft model has: the target's embedding (shared, frozen), an LM head and a RoPE table.

Draft vocabulary (`DrafterConfig.draft_vocab_size`, EAGLE-3's d2t): the LM head has Vd rows and draft id i is
target id i + d2t[i]. A drafter's logits are over its own vocabulary (Vd, or the target's V); every token id
outside a logits tensor is a target id — `to_target` / `draft_ids` convert at those edges. A target token outside
the draft vocabulary is never drafted; its cycle emits the target's own token, so verification stays exact. The
head is either the drafter's own [Vd, d] (a released EAGLE-3 head, trainable) or the target's rows d2t names,
frozen and taken from the target at load time (`share_head`), as the full-vocabulary head is."""

from __future__ import annotations

import torch
from torch import nn

from drafter_worker.config import DrafterConfig
from services.model_config import ModelConfig
from services.rope import RotaryTable


class DraftModelBase(nn.Module):
    def __init__(self, dcfg: DrafterConfig, cfg: ModelConfig, embed: torch.Tensor):
        super().__init__()
        self.dconfig, self.config = dcfg, cfg
        # embed [V, d]: the target's, shared and frozen, so no storage or random init of its own (a real
        # vocabulary's init was 0.65 s of each drafter's load)
        self.embed_tokens = nn.Embedding.from_pretrained(embed.detach(), freeze=True)
        vd = dcfg.draft_vocab_size
        self.lm_head = nn.Linear(cfg.hidden_size, vd or cfg.vocab_size, bias=False)  # the target's, or [Vd, d]
        if vd is not None:
            self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))  # [Vd] target id − draft id
            # [V] target id → draft id, Vd for a token outside the draft vocabulary (`index_vocab`)
            self.register_buffer("t2d", torch.full((cfg.vocab_size,), vd, dtype=torch.long), persistent=False)
        self._rotary: RotaryTable | None = None

    @property
    def feature_width(self) -> int:
        """Width of the target features it reads: num_taps · d."""
        return self.context.fc.in_features

    @property
    def reduced_vocab(self) -> bool:
        return self.dconfig.draft_vocab_size is not None

    @property
    def draft_vocab(self) -> int:
        """Rows of the drafter's logits: Vd, or the target's V."""
        return self.dconfig.draft_vocab_size or self.config.vocab_size

    def index_vocab(self, d2t: torch.Tensor | None = None) -> None:
        """Set d2t (when given) and derive t2d from it; after loading a checkpoint's d2t."""
        if not self.reduced_vocab:
            return
        if d2t is not None:
            self.d2t.copy_(d2t)
        hot = torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t  # [Vd] target ids, increasing
        self.t2d.fill_(len(self.d2t)).index_copy_(0, hot, torch.arange(len(hot), device=hot.device))

    def share_head(self, target_head: torch.Tensor) -> None:
        """The LM head becomes the target's rows [Vd, d] of the draft vocabulary (all of them for a full one),
        frozen: not trained, not stored with the drafter."""
        rows = target_head.detach().to(self.lm_head.weight)
        if self.reduced_vocab:
            rows = rows[torch.arange(len(self.d2t), device=rows.device) + self.d2t]
        self.lm_head.weight = nn.Parameter(rows, requires_grad=False)

    @property
    def shares_head(self) -> bool:
        return not self.lm_head.weight.requires_grad

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape) → target ids."""
        return ids + self.d2t[ids] if self.reduced_vocab else ids

    def draft_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids (any shape) → draft ids, Vd for a token outside the draft vocabulary."""
        return self.t2d[ids] if self.reduced_vocab else ids

    def scatter_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [..., Vd] → over the target's [..., V], −inf outside it."""
        if not self.reduced_vocab:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., torch.arange(len(self.d2t), device=logits.device) + self.d2t] = logits
        return full

    def rotary(self) -> RotaryTable:
        device = self.lm_head.weight.device
        if self._rotary is None or self._rotary.cos.device != device:
            self._rotary = RotaryTable(self.config.rope, self.config.head_dim, self.config.max_context, device)
        return self._rotary

"""DSpark's light heads on top of the parallel backbone.

Sequential head: p_k = softmax(U_k + B_k), where U_k = LMHead(h_k) comes from the one parallel forward
and B_k depends on the in-block prefix. Only an embedding lookup and an r×V product run per step.
  markov  B_k = W2 · W1[x_{k−1}]                       (slot 0 uses the anchor as x_0)
  gated   B_k = W2 · (g_k ⊙ W1[x_{k−1}]),  g_k = σ(G [h_k; W1[x_{k−1}]])
  rnn     z = [s_{k−1}; W1[x_{k−1}]; h_k] → gate, candidate, output;  s_k = σ(g)s_{k−1} + (1−σ(g))tanh(c);
          B_k = W2 · tanh(o)
Over a draft vocabulary of Vd ids, W1 has Vd + 1 rows (the last for a previous token outside it: the anchor
may be any target token) and W2 Vd; previous tokens arrive as draft ids (`DraftModelBase.draft_ids`).
Confidence head: c_k = σ(w · [h_k; W1[x_{k−1}]] + b), the conditional probability that x_k survives
verification given x_1..x_{k−1} did.
"""

from __future__ import annotations

import torch
from torch import nn

from drafter_worker.config import HeadType


class SequentialHead(nn.Module):
    def __init__(self, kind: HeadType, vocab_size: int, hidden_size: int, rank: int, other_row: bool = False):
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_embed = nn.Embedding(vocab_size + other_row, rank)  # W1 [V (+1), r]
        self.markov_proj = nn.Linear(rank, vocab_size, bias=False)  # W2 [V, r]
        nn.init.zeros_(self.markov_proj.weight)  # start as the plain backbone: B_k = 0
        if kind is HeadType.GATED:
            self.gate = nn.Linear(hidden_size + rank, rank)
        if kind is HeadType.RNN:
            self.cell = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def init_state(self, batch: int, like: torch.Tensor) -> torch.Tensor | None:
        return like.new_zeros(batch, self.rank) if self.kind is HeadType.RNN else None  # s_0 = 0 [A, r]

    def step(
        self,
        prev: torch.Tensor,  # [A] int64 x_{k−1}
        h: torch.Tensor,  # [A, d] backbone state of slot k
        state: torch.Tensor | None,  # [A, r] for rnn
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """→ bias B_k [A, V], previous-token embedding W1[x_{k−1}] [A, r], next state."""
        e = self.markov_embed(prev)  # [A, r]
        if self.kind is HeadType.MARKOV:
            return self.markov_proj(e), e, None
        if self.kind is HeadType.GATED:
            g = torch.sigmoid(self.gate(torch.cat([h, e], dim=-1)))
            return self.markov_proj(g * e), e, None
        gate, cand, out = self.cell(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)
        z = torch.sigmoid(gate)
        state = z * state + (1 - z) * torch.tanh(cand)
        return self.markov_proj(torch.tanh(out)), e, state

    def teacher_forced(self, prev: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training: ground-truth previous tokens prev [A, γ], h [A, γ, d] → B [A, γ, V], W1[prev] [A, γ, r]."""
        if self.kind is not HeadType.RNN:
            a, gamma = prev.shape
            bias, e, _ = self.step(prev.flatten(), h.flatten(0, 1), None)
            return bias.unflatten(0, (a, gamma)), e.unflatten(0, (a, gamma))
        state = self.init_state(prev.shape[0], h)
        biases, embeds = [], []
        for k in range(prev.shape[1]):
            bias, e, state = self.step(prev[:, k], h[:, k], state)
            biases.append(bias)
            embeds.append(e)
        return torch.stack(biases, dim=1), torch.stack(embeds, dim=1)


class ConfidenceHead(nn.Module):
    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)

    def forward(self, h: torch.Tensor, prev_embed: torch.Tensor) -> torch.Tensor:
        """h [..., d], W1[x_{k−1}] [..., r] → confidence logit z_k [...] (c_k = σ(z_k))."""
        return self.proj(torch.cat([h, prev_embed], dim=-1)).squeeze(-1)

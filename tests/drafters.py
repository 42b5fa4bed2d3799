"""Test drafters: random tokens with random sparse q, and an oracle that knows the answer."""

from __future__ import annotations

import torch

from drafter_worker.proposer import StatelessProposer
from services.sampling import truncate_to_sparse
from services.types import DraftBlock


class RandomProposer(StatelessProposer):
    """Random tokens, each sampled from a random distribution truncated to `k` ids (sparse q)."""

    def __init__(self, vocab: int, k: int = 8, seed: int = 0):
        self.vocab, self.k = vocab, k
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, contexts: dict[str, list[int]], gamma: int, params=None) -> dict[str, DraftBlock]:
        out = {}
        for rid in contexts:
            logits = torch.randn(gamma, self.vocab, generator=self.gen) * 3
            ids, probs = truncate_to_sparse(torch.softmax(logits, -1), self.k)  # [γ, k] each
            pick = torch.multinomial(probs, 1, generator=self.gen).squeeze(-1)  # [γ]
            tokens = ids.gather(-1, pick[:, None]).squeeze(-1).tolist()
            out[rid] = DraftBlock(tokens=tokens, q_ids=ids, q_probs=probs)
        return out


class OracleProposer(StatelessProposer):
    """Proposes the known continuation, with each token wrong with probability `error_rate`."""

    def __init__(self, answers: dict[str, list[int]], vocab: int, error_rate: float = 0.25, seed: int = 0):
        self.answers, self.vocab, self.error_rate = answers, vocab, error_rate
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, contexts: dict[str, list[int]], gamma: int, params=None) -> dict[str, DraftBlock]:
        out = {}
        for rid, ctx in contexts.items():
            tokens = list(self.answers[rid][len(ctx) : len(ctx) + gamma])
            for k in range(len(tokens)):
                if torch.rand((), generator=self.gen) < self.error_rate:
                    tokens[k] = int(torch.randint(0, self.vocab, (), generator=self.gen))
            out[rid] = DraftBlock(tokens=tokens)
        return out


class FixedDistributionProposer(StatelessProposer):
    """Every draft sampled from one fixed sparse q. A systematic q makes a biased rule visible."""

    def __init__(self, ids: list[int], probs: list[float], seed: int = 0):
        self.ids = torch.tensor(ids)  # [K]
        self.probs = torch.tensor(probs)  # [K]
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, contexts: dict[str, list[int]], gamma: int, params=None) -> dict[str, DraftBlock]:
        out = {}
        for rid in contexts:
            picks = torch.multinomial(self.probs, gamma, replacement=True, generator=self.gen)  # [γ]
            out[rid] = DraftBlock(tokens=self.ids[picks].tolist(), q_ids=self.ids.expand(gamma, -1),
                                  q_probs=self.probs.expand(gamma, -1))
        return out

"""Prompt-lookup (n-gram) drafter: model-free, deterministic, so q is one-hot at its tokens.

For the longest suffix of the context (between `min_n` and `max_n` tokens) that occurred
earlier, propose the tokens that followed its most recent earlier occurrence with a full γ
continuation (or the longest continuation when none has γ).
"""

from __future__ import annotations

import numpy as np

from drafter_worker.proposer import StatelessProposer
from services.types import DraftBlock, SamplingParams


class NgramProposer(StatelessProposer):
    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, contexts: dict[str, list[int]], gamma: int,
                params: dict[str, SamplingParams] | None = None) -> dict[str, DraftBlock]:
        return {rid: DraftBlock(tokens=self.lookup(tokens, gamma)) for rid, tokens in contexts.items()}

    def lookup(self, tokens: list[int], gamma: int) -> list[int]:
        length = len(tokens)
        if length < 2:
            return []
        arr = np.asarray(tokens, dtype=np.int64)  # [L]
        ends = np.flatnonzero(arr[:-1] == arr[-1])  # [C] earlier positions holding the last token
        matched = np.ones(len(ends), dtype=np.int64)  # [C] suffix tokens matched, ending at each
        for i in range(1, min(self.max_n, length - 1)):
            extend = (matched == i) & (ends >= i)
            extend[extend] = arr[ends[extend] - i] == arr[-1 - i]
            matched += extend
        for n in range(self.max_n, self.min_n - 1, -1):
            hits = ends[matched >= n]
            if hits.size == 0:
                continue
            full = hits[hits + gamma < length]  # matches followed by a whole block
            end = int(full[-1]) if full.size else int(hits[0])
            return tokens[end + 1 : end + 1 + gamma]
        return []

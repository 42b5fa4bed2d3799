"""Prompt-lookup (n-gram) drafter: model-free, deterministic, so q is one-hot at its tokens.

For the longest suffix of the context (between `min_n` and `max_n` tokens) that occurred
earlier, propose the tokens that followed its most recent earlier occurrence with a full γ
continuation (or the longest continuation when none has γ).
"""

from __future__ import annotations

from services.types import DraftBlock


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, contexts: dict[str, list[int]], gamma: int) -> dict[str, DraftBlock]:
        return {rid: DraftBlock(tokens=self.lookup(tokens, gamma)) for rid, tokens in contexts.items()}

    def lookup(self, tokens: list[int], gamma: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            best: list[int] = []
            # Most recent earlier match first: its continuation is the likeliest repeat.
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    follow = tokens[start + n : start + n + gamma]
                    if len(follow) > len(best):
                        best = follow
                    if len(best) == gamma:
                        break
            if best:
                return best
        return []

    def release(self, request_id: str) -> None:
        """Keeps no per-request state."""

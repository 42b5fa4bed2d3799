"""Fixed-length training windows over the tokenized corpora (`<domain>.<split>.bin`, uint16)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from training.data import DOMAINS


def load_tokens(data_dir: Path, split: str) -> dict[str, np.ndarray]:
    return {d: np.fromfile(data_dir / f"{d}.{split}.bin", dtype=np.uint16) for d in DOMAINS}


class WindowSampler:
    """Every (seq_len + 1)-token window of the train streams once per epoch, in a seeded random order."""

    def __init__(self, streams: dict[str, np.ndarray], seq_len: int, seed: int):
        self.stream = np.concatenate([streams[d] for d in DOMAINS]).astype(np.int64)  # [tokens]
        self.seq_len, self.seed = seq_len, seed
        self.num_windows = (len(self.stream) - 1) // seq_len
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, window permutation)

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng(self.seed + epoch).permutation(self.num_windows))
        return self._order[1]

    def batch(self, index: int, batch_size: int) -> torch.Tensor:
        """Batch number `index` (counting across epochs) → [B, seq_len + 1] token ids."""
        rows = []
        for k in range(index * batch_size, (index + 1) * batch_size):
            epoch, pos = divmod(k, self.num_windows)
            start = int(self._permutation(epoch)[pos]) * self.seq_len
            rows.append(self.stream[start : start + self.seq_len + 1])
        return torch.from_numpy(np.stack(rows))


def eval_windows(stream: np.ndarray, seq_len: int, max_tokens: int) -> torch.Tensor:
    """The first `max_tokens` of a validation stream as [N, seq_len + 1] windows."""
    n = min(max_tokens, len(stream) - 1) // seq_len
    return torch.from_numpy(np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
                            .astype(np.int64))

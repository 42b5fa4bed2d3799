"""Preallocated, position-indexed KV cache with one slot per request.

Rollback of rejected drafts is a length change (`truncate`); rows past a slot's length are
garbage that the next write overwrites, and attention never reads past the length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.errors import CapacityError, InvalidRequestError
from services.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class CacheUsage:
    slots_total: int
    slots_used: int
    tokens_used: int  # cached positions over all slots
    tokens_total: int  # slots_total * max_len
    bytes_total: int
    bytes_per_token: int


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        if num_slots < 1 or max_len < 2:
            raise ValueError("KV cache needs at least one slot of at least two positions")
        shape = (cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, S, Hkv, max_len, Dh]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, S, Hkv, max_len, Dh]
        self.max_len = max_len
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._slot: dict[str, int] = {}
        self._length: dict[str, int] = {}

    def has_free_slot(self) -> bool:
        return bool(self._free)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self, request_id: str) -> int:
        if request_id in self._slot:
            raise InvalidRequestError(f"request {request_id!r} already holds a KV slot")
        if not self._free:
            raise CapacityError("no free KV slot")
        slot = self._free.pop()
        self._slot[request_id] = slot
        self._length[request_id] = 0
        return slot

    def free(self, request_id: str) -> None:
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            del self._length[request_id]
            self._free.append(slot)

    def slot(self, request_id: str) -> int:
        try:
            return self._slot[request_id]
        except KeyError:
            raise InvalidRequestError(f"request {request_id!r} holds no KV slot") from None

    def length(self, request_id: str) -> int:
        self.slot(request_id)
        return self._length[request_id]

    def room(self, request_id: str) -> int:
        """Positions still free in the request's slot."""
        return self.max_len - self.length(request_id)

    def append(self, request_id: str, num_tokens: int) -> tuple[int, int]:
        """Reserve the next `num_tokens` positions → (slot, start). The forward then writes them."""
        start = self.length(request_id)
        if start + num_tokens > self.max_len:
            raise InvalidRequestError(
                f"request {request_id!r} needs {start + num_tokens} positions; a slot holds {self.max_len}"
            )
        self._length[request_id] = start + num_tokens
        return self._slot[request_id], start

    def copy_prefix(self, source_id: str, request_id: str, length: int) -> None:
        """Give `request_id` (just allocated) the first `length` cached positions of `source_id` (same prompt)."""
        if not 0 < length <= self.length(source_id) or self.length(request_id):
            raise InvalidRequestError(f"cannot copy {length} positions of {source_id!r} to {request_id!r}")
        src, dst = self._slot[source_id], self._slot[request_id]
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
        self._length[request_id] = length

    def truncate(self, request_id: str, length: int) -> None:
        """Keep the first `length` positions (rollback of rejected drafts)."""
        if not 0 <= length <= self.length(request_id):
            raise InvalidRequestError(f"cannot truncate {request_id!r} to {length}")
        self._length[request_id] = length

    def usage(self) -> CacheUsage:
        num_slots = self.k.shape[1]
        per_token = 2 * self.k[:, 0, :, 0].numel() * self.k.element_size()
        return CacheUsage(
            slots_total=num_slots,
            slots_used=len(self._slot),
            tokens_used=sum(self._length.values()),
            tokens_total=num_slots * self.max_len,
            bytes_total=2 * self.k.numel() * self.k.element_size(),
            bytes_per_token=per_token,
        )

"""The drafter's context keys and values: per layer one cache [S, Hkv, L, Dh] of slots, a slot per request.

Only positions whose target features were committed hold context (0..n−1 of a request with n folded in).
The fused block path (`fused_block.py`) also writes its block rows' keys past them, at the block's own
positions: they are read only by that block and overwritten when the next features are folded in. Slots
and length grow by doubling, so a drafter serving few short requests holds little.
"""

from __future__ import annotations

import torch

ContextKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v) [..., Hkv, n, Dh]


class ContextCache:
    """`shape` (Hkv, Dh, dtype, device) where the drafter knows it; else the first `write` sets it (the
    attention of a converted MTP layer, e.g. DeepSeek's MLA, keeps keys and values of their own widths)."""

    def __init__(self, layers: int, max_len: int, shape: tuple[int, int, torch.dtype, torch.device] | None = None,
                 slots: int = 4, length: int = 256):
        self.layers, self.max_len, self._start = layers, max_len, (slots, min(length, max_len))
        self.k: list[torch.Tensor] = []  # per layer [S, Hkv, L, Dh], once allocated
        self.v: list[torch.Tensor] = []
        self._slots: dict[str, int] = {}
        self._free = list(range(slots))
        if shape is not None:
            self._allocate(*shape)

    def _allocate(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                  v_dim: int | None = None) -> None:
        slots, length = self._start
        self.k = [torch.zeros(slots, kv_heads, length, head_dim, dtype=dtype, device=device)
                  for _ in range(self.layers)]
        self.v = [torch.zeros(slots, kv_heads, length, v_dim or head_dim, dtype=dtype, device=device)
                  for _ in range(self.layers)]

    @property
    def length(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    def slot(self, rid: str) -> int:
        """The request's slot, assigned at its first use."""
        if rid not in self._slots:
            if not self._free:
                self._grow(slots=2 * len(self._slots))
            self._slots[rid] = slot = min(self._free)  # the lowest: the slots in use stay few and packed
            self._free.remove(slot)
        return self._slots[rid]

    def release(self, rid: str) -> None:
        slot = self._slots.pop(rid, None)
        if slot is not None:
            self._free.append(slot)

    def fit(self, length: int) -> None:
        """Make room for positions 0..length−1 in every slot (at most `max_len`)."""
        if length > self.max_len:
            raise ValueError(f"context of {length} positions beyond the drafter's {self.max_len}")
        if length > self.length:
            self._grow(length=min(self.max_len, max(length, 2 * self.length)))

    def write(self, rid: str, start: int, kv: ContextKV) -> None:
        """Per layer k, v [Hkv, n, Dh] of positions start..start+n−1."""
        n = kv[0][0].shape[1]
        if not self.k:
            k, v = kv[0]
            self._allocate(k.shape[0], k.shape[2], k.dtype, k.device, v.shape[2])
        self.fit(start + n)
        slot = self.slot(rid)
        for layer, (k, v) in enumerate(kv):
            self.k[layer][slot, :, start : start + n] = k
            self.v[layer][slot, :, start : start + n] = v

    def read(self, rid: str, n: int) -> ContextKV:
        """Per layer the request's first n positions, views k, v [Hkv, n, Dh]."""
        slot = self.slot(rid)
        return [(k[slot, :, :n], v[slot, :, :n]) for k, v in zip(self.k, self.v, strict=True)]

    def padded(self, rids: list[str], lengths: list[int]) -> tuple[ContextKV, torch.Tensor]:
        """Per layer (k, v) [R, Hkv, S, Dh] of the requests' contexts, S the longest, and the mask [R, S]."""
        longest = max(lengths)
        dev = self.k[0].device
        slots = torch.tensor([self.slot(rid) for rid in rids], device=dev)
        mask = torch.arange(longest, device=dev)[None] < torch.tensor(lengths, device=dev)[:, None]
        return [(k[slots, :, :longest], v[slots, :, :longest]) for k, v in zip(self.k, self.v, strict=True)], mask

    def _grow(self, slots: int | None = None, length: int | None = None) -> None:
        if not self.k:  # nothing held yet: the first write allocates at these sizes
            self._free += list(range(self._start[0], slots or self._start[0]))
            self._start = (slots or self._start[0], length or self._start[1])
            return
        old_slots, _, old_len, _ = self.k[0].shape
        slots, length = slots or old_slots, length or old_len
        for cache in (self.k, self.v):
            for layer, t in enumerate(cache):
                new = t.new_zeros(slots, t.shape[1], length, t.shape[3])
                new[:old_slots, :, :old_len] = t
                cache[layer] = new
        self._free += list(range(old_slots, slots))

"""One attention call per layer for every request of a step: the ragged layout cut into query blocks.

A step's new tokens arrive flattened as N rows: each request's rows are contiguous, and request r's
first row sits at cache position `starts[r]` of slot `slots[r]`. `AttentionPlan.build` cuts every
request's rows into blocks of at most `block` rows (a verify item of ℓ + 1 rows is one block; a prefill
chunk is several), so all of a step's attention is one SDPA over a padded [B, H, Qb, Lb] batch:

- each block reads the keys of its own slot, positions 0..Lb-1, Lb the step's longest reach rounded up
  to a multiple of `KV_MULTIPLE`; the mask lets a query row see exactly the positions 0..its own;
- padding rows of a block repeat one of its real rows and are dropped again on the way out.

Why this keeps a position's output independent of its neighbours (the batch invariance that makes
greedy speculation equal plain greedy): SDPA treats every (block, head) independently, a query row's
scores are dot products over its own keys only, masked keys add exact zeros, and Lb moves only in whole
multiples of `KV_MULTIPLE`, so no reduction changes order. `tests/test_attention.py` checks it bit for
bit against `attend_per_request`, the reference loop this file replaced.

Sliding-window layers (Gemma) attend through `AttentionPlan.windowed`: the same blocks, keys and SDPA call,
with each row's mask cut to the keys in (p - window, p]; the keys behind the window stay in the cache and
are read, masked, so windowed and global layers share one cache layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KV_MULTIPLE = 64  # keys read per block are padded to a multiple of this
MAX_BLOCK = 16  # query rows per block at most (a long prefill chunk becomes several blocks)


@dataclass(slots=True)
class AttentionPlan:
    """Index tensors of one step, built once and shared by every layer."""

    write_slots: torch.Tensor  # [N] int64, cache slot each new row's key/value is written to
    write_pos: torch.Tensor  # [N] int64, its cache position
    block_slots: torch.Tensor  # [B] int64, slot whose keys each query block reads
    gather_rows: torch.Tensor  # [B, Qb] int64, row of N at each block position (padding repeats a row)
    mask: torch.Tensor  # [B, 1, Qb, Lb] bool, True where a block row may attend
    scatter: torch.Tensor  # [N] int64, index into the flattened [B * Qb] block rows of each real row

    @property
    def kv_len(self) -> int:  # Lb (a shape, not a field, so a compiled step sees one tensor size, no int)
        return self.mask.shape[-1]

    def windowed(self, window: int) -> AttentionPlan:
        """The same step with a row at position p seeing only keys in (p - window, p] (HF's sliding window).
        Derived from the causal mask, whose True entries are a row's prefix 0..p (padded keys, as a compiled
        step's buckets add, are False), so a compiled step computes it from tensors already in its graph."""
        reach = self.mask.sum(-1, keepdim=True)  # [B, 1, Qb, 1] p + 1 of each row
        keys = torch.arange(self.mask.shape[-1], device=self.mask.device)  # [Lb]
        mask = self.mask & (keys >= reach - window)  # [B, 1, Qb, Lb]
        return AttentionPlan(self.write_slots, self.write_pos, self.block_slots, self.gather_rows, mask,
                             self.scatter)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.write_slots, self.write_pos, self.block_slots, self.gather_rows, self.mask, self.scatter)

    @staticmethod
    def build(slots: list[int], starts: list[int], lens: list[int], device: torch.device,
              max_len: int, block: int | None = None) -> AttentionPlan:
        """`slots`, `starts`, `lens` [R] as in `RaggedLayout`; `max_len` caps Lb at the cache's length."""
        if block is None:
            # At least two rows: CPU SDPA is about 2x slower in bf16 for one query row than for two, and the
            # duplicated row changes no bits.
            block = min(MAX_BLOCK, max(2, 1 << (max(lens) - 1).bit_length()))
        write_slots, block_slots, gather, qpos, scatter = [], [], [], [], []
        row = 0
        for slot, start, length in zip(slots, starts, lens, strict=True):
            write_slots.extend([slot] * length)
            for first in range(0, length, block):
                n = min(block, length - first)
                base = len(gather) * block
                scatter.extend(range(base, base + n))
                rows = [row + first + j for j in range(n)]
                gather.append(rows + [rows[-1]] * (block - n))
                pos = [start + first + j for j in range(n)]
                qpos.append(pos + [pos[-1]] * (block - n))
                block_slots.append(slot)
            row += length
        reach = max(p[-1] for p in qpos) + 1
        kv_len = min(max_len, -(-reach // KV_MULTIPLE) * KV_MULTIPLE)
        positions = [start + j for start, length in zip(starts, lens, strict=True) for j in range(length)]
        qpos_t = torch.tensor(qpos, device=device)  # [B, Qb]
        mask = torch.arange(kv_len, device=device)[None, None, :] <= qpos_t[:, :, None]  # [B, Qb, Lb]

        def t(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return AttentionPlan(t(write_slots), t(positions), t(block_slots), t(gather), mask[:, None], t(scatter))


def attend(
    q: torch.Tensor,  # [N, H, Dh] rotated queries of the step's new rows
    k: torch.Tensor,  # [N, Hkv, Dh] their rotated keys
    v: torch.Tensor,  # [N, Hkv, Dh]
    plan: AttentionPlan,
    k_cache: torch.Tensor,  # [S, Hkv, L, Dh] this layer's keys, all slots
    v_cache: torch.Tensor,  # [S, Hkv, L, Dh]
    scale: float | None = None,  # softmax scale; None: SDPA's 1/sqrt(Dh)
) -> torch.Tensor:
    """Write the new keys/values into their slots, then attend every row causally over its slot → [N, H, Dh]."""
    heads, dh = q.shape[1:]
    k_cache[plan.write_slots, :, plan.write_pos] = k
    v_cache[plan.write_slots, :, plan.write_pos] = v
    keys = k_cache[plan.block_slots, :, : plan.kv_len]  # [B, Hkv, Lb, Dh]
    values = v_cache[plan.block_slots, :, : plan.kv_len]  # [B, Hkv, Lb, Dh]
    queries = q[plan.gather_rows].transpose(1, 2)  # [B, H, Qb, Dh]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=plan.mask, enable_gqa=True, scale=scale)
    return out.transpose(1, 2).reshape(-1, heads, dh)[plan.scatter]  # [N, H, Dh]


def attend_per_request(q, k, v, slots: list[int], starts: list[int], lens: list[int], k_cache, v_cache,
                       window: int | None = None):
    """The reference: one SDPA call per request over exactly its own prefix (shapes as in `attend`), or over
    the last `window` positions of it."""
    out = torch.empty_like(q)  # [N, H, Dh]
    offset = 0
    for slot, start, length in zip(slots, starts, lens, strict=True):
        rows, end = slice(offset, offset + length), start + length
        k_cache[slot, :, start:end] = k[rows].transpose(0, 1)
        v_cache[slot, :, start:end] = v[rows].transpose(0, 1)
        mask = torch.ones(length, end, dtype=torch.bool, device=q.device).tril(start)  # [n, T]
        if window is not None:
            mask = mask.triu(start - window + 1)
        o = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], k_cache[slot, :, :end][None],
                                           v_cache[slot, :, :end][None], attn_mask=mask, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
        offset += length
    return out

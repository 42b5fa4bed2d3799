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

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

KV_MULTIPLE = 64  # keys read per block are padded to a multiple of this
MAX_BLOCK = 16  # query rows per block at most (a long prefill chunk becomes several blocks)


@dataclass(slots=True)
class AttentionPlan:
    """Index tensors of one step, built once and shared by every layer: one SDPA call over blocks of Qb rows,
    and, where the step's requests want blocks of different sizes, `rest`: the next size's call."""

    write_slots: torch.Tensor  # [N] int64, cache slot each new row's key/value is written to
    write_pos: torch.Tensor  # [N] int64, its cache position
    block_slots: torch.Tensor  # [B] int64, slot whose keys each query block reads
    gather_rows: torch.Tensor  # [B, Qb] int64, row of N at each block position (padding repeats a row)
    mask: torch.Tensor  # [B, 1, Qb, Lb] bool, True where a block row may attend
    scatter: torch.Tensor  # [n] int64, index into the flattened [B * Qb] block rows of each real row
    # a: the blocks read slots a, a+1, ..., a+B-1 in order (one block each), so their keys are a view of the
    # cache, not a gathered copy (eager steps only: a compiled step leaves it None and gathers)
    slot_base: int | None = None
    rows: torch.Tensor | None = None  # [n] int64, the rows of N these blocks answer, in order; None: all N
    rest: AttentionPlan | None = None  # the blocks of the step's other block sizes (eager steps only)

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
        rest = None if self.rest is None else self.rest.windowed(window)
        return AttentionPlan(self.write_slots, self.write_pos, self.block_slots, self.gather_rows, mask,
                             self.scatter, self.slot_base, self.rows, rest)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What a compiled step takes (a plan of one block size, built with `block` given)."""
        assert self.rest is None and self.rows is None, "a compiled step takes a plan of one block size"
        return (self.write_slots, self.write_pos, self.block_slots, self.gather_rows, self.mask, self.scatter)

    @staticmethod
    def build(slots: list[int], starts: list[int], lens: list[int], device: torch.device,
              max_len: int, block: int | None = None) -> AttentionPlan:
        """`slots`, `starts`, `lens` [R] as in `RaggedLayout`; `max_len` caps Lb at the cache's length.
        `block`: the rows of every block (one SDPA call; `step_block(lens)` is the smallest that fits the
        step). None: each request gets `step_block([its rows])`, one call per size present, so a decode row
        beside a prefill chunk is not padded to the chunk's 16 rows."""
        sizes = [block] * len(lens) if block is not None else [step_block([n]) for n in lens]
        firsts = list(itertools.accumulate(lens, initial=0))
        positions = [start + j for start, length in zip(starts, lens, strict=True) for j in range(length)]
        write_slots = [slot for slot, length in zip(slots, lens, strict=True) for _ in range(length)]
        plan = None
        for size in sorted(set(sizes), reverse=True):
            chosen = [r for r in range(len(lens)) if sizes[r] == size]
            plan = _blocks([slots[r] for r in chosen], [starts[r] for r in chosen], [lens[r] for r in chosen],
                           [firsts[r] for r in chosen], size, max_len, device, plan)
        plan.write_slots, plan.write_pos = _long(write_slots, device), _long(positions, device)
        if plan.rest is None:
            plan.rows = None  # one block size: the blocks answer every row, in order
        return plan


def step_block(lens: list[int]) -> int:
    """Rows per block for requests of `lens` rows: a power of two, 2..MAX_BLOCK. At least two: CPU SDPA is
    about 2x slower in bf16 for one query row than for two, and the duplicated row changes no bits."""
    return min(MAX_BLOCK, max(2, 1 << (max(lens) - 1).bit_length()))


def _long(values: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _blocks(slots: list[int], starts: list[int], lens: list[int], firsts: list[int], block: int, max_len: int,
            device: torch.device, rest: AttentionPlan | None) -> AttentionPlan:
    """The blocks of `block` rows of these requests (`firsts`: each one's first row in N), in slot order (a
    block's place in the batch changes no bits) so that requests on consecutive slots read a view of the cache."""
    blocks = []  # (slot, rows of N, their positions, answered)
    for r in sorted(range(len(slots)), key=slots.__getitem__):
        for first in range(0, lens[r], block):
            n = min(block, lens[r] - first)
            blocks.append((slots[r], range(firsts[r] + first, firsts[r] + first + n),
                           range(starts[r] + first, starts[r] + first + n), True))
    used = [b[0] for b in blocks]
    base = used[0]
    span = used[-1] - base + 1
    # One block per slot and few slots between them unused: a block of position 0 on each of those (read,
    # answered and dropped) costs less than gathering every block's keys.
    view = len(set(used)) == len(used) and span <= 2 * len(used)
    if view and span > len(used):
        idle = sorted(set(range(base, base + span)) - set(used))
        any_row = blocks[0][1][:1]
        blocks = sorted(blocks + [(slot, any_row, range(1), False) for slot in idle], key=lambda b: b[0])
    gather, qpos, pieces = [], [], []
    for i, (_, rows, pos, answered) in enumerate(blocks):
        pad = block - len(rows)
        gather.append([*rows] + [rows[-1]] * pad)
        qpos.append([*pos] + [pos[-1]] * pad)
        if answered:
            pieces.append((rows[0], i * block, len(rows)))  # (row of N, place in the flat blocks, rows)
    pieces.sort()  # back in row order
    reach = max(p[-1] for p in qpos) + 1
    kv_len = min(max_len, -(-reach // KV_MULTIPLE) * KV_MULTIPLE)
    mask = torch.arange(kv_len, device=device)[None, None, :] <= torch.tensor(qpos, device=device)[:, :, None]
    empty = torch.empty(0, dtype=torch.long, device=device)  # the writes are the whole step's, set by build
    return AttentionPlan(
        empty, empty, _long([b[0] for b in blocks], device), _long(gather, device), mask[:, None],  # [B, 1, Qb, Lb]
        _long([at + j for _, at, n in pieces for j in range(n)], device), base if view else None,
        _long([row + j for row, _, n in pieces for j in range(n)], device), rest)


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
    k_cache[plan.write_slots, :, plan.write_pos] = k
    v_cache[plan.write_slots, :, plan.write_pos] = v
    if plan.rest is None:
        return _attend_blocks(q, plan, k_cache, v_cache, scale)
    out = torch.empty_like(q)
    part = plan
    while part is not None:
        out[part.rows] = _attend_blocks(q, part, k_cache, v_cache, scale)
        part = part.rest
    return out


def _attend_blocks(q, plan: AttentionPlan, k_cache, v_cache, scale) -> torch.Tensor:
    """One SDPA call over the plan's blocks → [n, H, Dh] for its rows.

    The query heads sharing a key head are stacked as rows of one problem ([B, Hkv, G·Qb, Dh]) rather than
    passed with `enable_gqa`, which repeats the keys per query head: the same dot products, a third of the
    (block, head) problems and no copy (3× faster at batch 64 in bf16 on CPU, with the keys a view)."""
    heads, dh = q.shape[1:]
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    blocks, qb = plan.gather_rows.shape
    if plan.slot_base is None:
        keys = k_cache[plan.block_slots, :, : plan.kv_len]  # [B, Hkv, Lb, Dh]
        values = v_cache[plan.block_slots, :, : plan.kv_len]  # [B, Hkv, Lb, Dh]
    else:
        chosen = slice(plan.slot_base, plan.slot_base + blocks)
        keys, values = k_cache[chosen, :, : plan.kv_len], v_cache[chosen, :, : plan.kv_len]
    queries = q[plan.gather_rows].view(blocks, qb, kv_heads, group, dh)  # [B, Qb, Hkv, G, Dh]
    queries = queries.permute(0, 2, 3, 1, 4).reshape(blocks, kv_heads, group * qb, dh)  # [B, Hkv, G·Qb, Dh]
    mask = plan.mask.expand(blocks, group, qb, plan.kv_len).reshape(blocks, 1, group * qb, plan.kv_len)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)  # [B, Hkv, G·Qb, Dh]
    out = out.view(blocks, kv_heads, group, qb, dh).permute(0, 3, 1, 2, 4)  # [B, Qb, Hkv, G, Dh]
    return out.reshape(blocks * qb, heads, dh)[plan.scatter]  # [n, H, Dh]


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

"""The one-call attention of a step equals the per-request reference, and a row's output is batch-invariant."""

import pytest
import torch

from services.attention import KV_MULTIPLE, AttentionPlan, attend, attend_per_request

H, HKV, DH, SLOTS, MAX_LEN = 4, 2, 16, 4, 200


def _step(slots, starts, lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q = torch.randn(n, H, DH, generator=g).to(dtype)
    k = torch.randn(n, HKV, DH, generator=g).to(dtype)
    v = torch.randn(n, HKV, DH, generator=g).to(dtype)
    cache = torch.randn(2, SLOTS, HKV, MAX_LEN, DH, generator=g).to(dtype)  # stale garbage past each length
    return q, k, v, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [
    ([0], [0], [37]),  # a prefill chunk: three blocks of 16
    ([1, 3, 0], [50, 9, 120], [1, 1, 1]),  # plain decoding of three requests
    ([2, 0, 1], [64, 7, 130], [8, 1, 5]),  # verify items of different lengths beside a decode
    ([3, 1], [0, 100], [20, 4]),  # prefill beside verify
])
def test_one_call_equals_per_request(dtype, layout):
    slots, starts, lens = layout
    q, k, v, cache = _step(slots, starts, lens, dtype)
    ref_cache = cache.clone()
    plan = AttentionPlan.build(slots, starts, lens, q.device, MAX_LEN)
    out = attend(q, k, v, plan, cache[0], cache[1])
    ref = attend_per_request(q, k, v, slots, starts, lens, ref_cache[0], ref_cache[1])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    for slot, start, length in zip(slots, starts, lens, strict=True):  # the new keys landed where they belong
        assert torch.equal(cache[:, slot, :, start : start + length], ref_cache[:, slot, :, start : start + length])


def test_a_rows_output_does_not_depend_on_its_neighbours():
    """Position 70 of slot 2 decoded alone, then as the third row of a verify block beside other requests:
    the same bits in bf16 (what greedy speculation = plain greedy rests on). Not in fp32: CPU SDPA's fp32
    GEMMs give a row different bits at different row and key counts (measured: 210 of 240 rows differ)."""
    q, k, v, cache = _step([2, 0, 1], [68, 5, 150], [8, 3, 2], torch.bfloat16)
    together = attend(q, k, v, AttentionPlan.build([2, 0, 1], [68, 5, 150], [8, 3, 2], q.device, MAX_LEN),
                      cache[0], cache[1])
    # Alone: rows 0..1 of slot 2 are already cached by the call above; row 2 is decoded by itself.
    alone = attend(q[2:3], k[2:3], v[2:3], AttentionPlan.build([2], [70], [1], q.device, MAX_LEN), cache[0], cache[1])
    assert torch.equal(alone[0], together[2])


def test_plan_blocks_and_kv_reach():
    plan = AttentionPlan.build([1, 0], [10, 3], [20, 1], torch.device("cpu"), MAX_LEN, block=16)
    assert plan.gather_rows.shape == (3, 16)  # 20 rows → blocks of 16 + 4; the decode is its own block
    assert plan.block_slots.tolist() == [0, 1, 1]  # in slot order
    assert plan.slot_base is None  # slot 1 has two blocks: its keys are gathered
    assert plan.kv_len == KV_MULTIPLE  # the longest reach is position 29
    assert plan.scatter.tolist() == [*range(16, 36), 0]
    assert plan.mask[0, 0, 0].sum() == 4 and plan.mask[1, 0, 0].sum() == 11
    assert plan.rest is None and plan.rows is None


def test_each_block_size_its_own_call():
    """Without a fixed block, the decode beside a prefill chunk is a block of 2 rows, not of 16: two calls."""
    plan = AttentionPlan.build([1, 0, 2], [10, 3, 7], [20, 1, 2], torch.device("cpu"), MAX_LEN)
    assert plan.block_slots.tolist() == [0, 1, 2]  # the two short requests, and idle slot 1 between them
    assert plan.gather_rows.shape == (3, 2) and plan.slot_base == 0
    assert plan.rows.tolist() == [20, 21, 22] and plan.scatter.tolist() == [0, 4, 5]
    assert plan.rest.gather_rows.shape == (2, 16) and plan.rest.rows.tolist() == list(range(20))
    assert plan.rest.rest is None and plan.write_slots.tolist() == [1] * 20 + [0, 2, 2]
    assert AttentionPlan.build([0], [190], [5], torch.device("cpu"), MAX_LEN).kv_len == MAX_LEN  # capped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_consecutive_slots_read_a_view_with_the_same_bits(dtype):
    """Requests on slots 1, 2, 3 (in any order) read their keys as a view of the cache; the gathered copy the
    plan otherwise takes gives the same bits, so which one a step takes cannot change a row."""
    slots, starts, lens = [3, 1, 2], [40, 9, 77], [1, 8, 5]
    q, k, v, cache = _step(slots, starts, lens, dtype)
    plan = AttentionPlan.build(slots, starts, lens, q.device, MAX_LEN, block=8)
    assert plan.slot_base == 1 and plan.block_slots.tolist() == [1, 2, 3]
    viewed = attend(q, k, v, plan, cache[0].clone(), cache[1].clone())
    plan.slot_base = None
    gathered = attend(q, k, v, plan, cache[0], cache[1])
    assert torch.equal(viewed, gathered)


def test_slots_between_the_requests_are_read_not_gathered():
    """Requests on slots 0, 2, 3: slot 1 (free, or prefilling in a block of another size) gets a block of
    position 0 so the keys stay a view; its output is dropped and the rows are those of the gathered plan."""
    slots, starts, lens = [3, 0, 2], [40, 9, 77], [1, 1, 1]
    q, k, v, cache = _step(slots, starts, lens, torch.bfloat16)
    plan = AttentionPlan.build(slots, starts, lens, q.device, MAX_LEN)
    assert plan.slot_base == 0 and plan.block_slots.tolist() == [0, 1, 2, 3] and plan.scatter.numel() == 3
    viewed = attend(q, k, v, plan, cache[0].clone(), cache[1].clone())
    ref = attend_per_request(q, k, v, slots, starts, lens, cache[0].clone(), cache[1].clone())
    torch.testing.assert_close(viewed, ref, atol=2e-2, rtol=2e-2)
    gathered = AttentionPlan.build([0, 2, 3], [9, 77, 40], [1, 1, 1], q.device, MAX_LEN)  # reordered rows
    assert gathered.block_slots.tolist() == [0, 1, 2, 3]
    spread = AttentionPlan.build([0, 9], [9, 77], [1, 1], q.device, MAX_LEN)  # mostly idle between: gathered
    assert spread.slot_base is None and spread.block_slots.tolist() == [0, 9]

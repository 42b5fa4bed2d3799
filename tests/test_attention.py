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
    plan = AttentionPlan.build([1, 0], [10, 3], [20, 1], torch.device("cpu"), MAX_LEN)
    assert plan.gather_rows.shape == (3, 16)  # 20 rows → blocks of 16 + 4; the decode is its own block
    assert plan.block_slots.tolist() == [1, 1, 0]
    assert plan.kv_len == KV_MULTIPLE  # the longest reach is position 29
    assert plan.scatter.tolist() == [*range(0, 20), 32]
    assert plan.mask[2, 0, 0].sum() == 4 and plan.mask[0, 0, 0].sum() == 11
    assert AttentionPlan.build([0], [190], [5], torch.device("cpu"), MAX_LEN).kv_len == MAX_LEN  # capped

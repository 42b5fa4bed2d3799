"""Slot allocation, rollback, reuse and accounting of the KV cache."""

from __future__ import annotations

import pytest
import torch

from services.errors import CapacityError, InvalidRequestError
from verifier_worker.kv_cache import KVCache


@pytest.fixture
def cache(tiny_model):
    return KVCache(tiny_model.config, num_slots=2, max_len=10, dtype=torch.float32, device=torch.device("cpu"))


def test_append_truncate_free_reuse(cache):
    slot = cache.allocate("a")
    assert cache.append("a", 4) == (slot, 0)
    assert cache.append("a", 3) == (slot, 4)
    cache.truncate("a", 5)  # two rejected drafts rolled back
    assert cache.length("a") == 5
    assert cache.append("a", 2) == (slot, 5)  # the next write lands where the rollback left off
    cache.free("a")
    assert cache.allocate("b") == slot  # the freed slot is reused, from length 0
    assert cache.length("b") == 0


def test_over_capacity_is_refused_cleanly(cache):
    cache.allocate("a")
    cache.allocate("b")
    with pytest.raises(CapacityError):
        cache.allocate("c")
    cache.append("a", 3)
    assert cache.length("a") == 3 and cache.length("b") == 0  # neighbours untouched


def test_overflowing_a_slot_is_refused(cache):
    cache.allocate("a")
    cache.append("a", 8)
    with pytest.raises(InvalidRequestError, match="needs 11 positions"):
        cache.append("a", 3)
    assert cache.length("a") == 8


def test_bad_ids_and_truncations(cache):
    with pytest.raises(InvalidRequestError):
        cache.length("nobody")
    cache.allocate("a")
    with pytest.raises(InvalidRequestError):
        cache.allocate("a")
    cache.append("a", 2)
    with pytest.raises(InvalidRequestError):
        cache.truncate("a", 3)
    cache.free("nobody")  # freeing an unknown id is a no-op


def test_usage_accounting(cache, tiny_model):
    cfg = tiny_model.config
    cache.allocate("a")
    cache.append("a", 6)
    usage = cache.usage()
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert usage.bytes_per_token == per_token
    assert usage.bytes_total == per_token * 2 * 10
    assert (usage.slots_used, usage.tokens_used, usage.tokens_total) == (1, 6, 20)

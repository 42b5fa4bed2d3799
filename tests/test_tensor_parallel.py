"""Tensor parallelism: a TP=2 replica of the shipped target computes what the unsharded model computes.

Two spawned ranks on 127.0.0.1 (gloo): rank 0 drives an unchanged Engine, rank 1 follows. The parent
computes the TP=1 reference meanwhile and compares what rank 0 sends back.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.layers import RaggedLayout
from services.loader import load_model
from services.model import CausalLM
from services.model_config import default_tap_layers
from services.registry import resolve_model
from services.types import SamplingParams
from tests.drafters import OracleProposer
from verifier_worker.engine import Engine, EngineConfig
from verifier_worker.kv_cache import KVCache
from verifier_worker.profile import profile_sps
from verifier_worker.tensor_parallel import TensorParallelDriver, follow, init_group, shard_model

WORLD = 2
MAX_TOKENS = 24
TIMEOUT_S = 120


def _load() -> CausalLM:
    return load_model(resolve_model("dspark-target"), "float32", "cpu", tap_layers=default_tap_layers(8))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 8192, (n,), generator=g).tolist() for n in (5, 13, 21)]


def _ragged_forwards(model) -> list[tuple]:
    """Three ragged forwards over one cache: prefill two slots, a mixed step, a verify-like step."""
    cache = KVCache(model.config, 3, 64, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    outs = []
    for slots, starts, lens in (([2, 0], [0, 0], [7, 12]), ([0, 1, 2], [12, 0, 7], [3, 5, 1]),
                                ([2, 0], [8, 15], [2, 4])):
        n = sum(lens)
        ids = torch.randint(2, 8192, (n,), generator=g)
        positions = torch.cat([torch.arange(s, s + k) for s, k in zip(starts, lens, strict=True)])
        layout = RaggedLayout(slots, starts, lens)
        with torch.inference_mode():
            out = model(ids, positions, layout, cache.k, cache.v, torch.arange(n))
        outs.append((out.logits.numpy().copy(), out.features.numpy().copy()))
    return outs


def _generate(model) -> dict[str, list[list[int]]]:
    """Greedy generations: plain decoding, then speculative with oracle drafts (accepts and rollbacks).
    Two slots for three prompts and an 8-token budget: chunked prefill and slot reuse."""
    engine = Engine(model, EngineConfig(num_slots=2, max_len=128, max_batch_tokens=8))
    params = SamplingParams(max_tokens=MAX_TOKENS)
    prompts = _prompts()
    plain = InProcessRouter(engine).generate([GenerationRequest(f"p{i}", p, params) for i, p in enumerate(prompts)])
    answers = {f"s{i}": p + r.token_ids for i, (p, r) in enumerate(zip(prompts, plain, strict=True))}
    oracle = OracleProposer(answers, model.config.vocab_size, error_rate=0.3, seed=1)
    spec = InProcessRouter(engine, oracle, Policy.FIXED, gamma=4).generate(
        [GenerationRequest(f"s{i}", p, params) for i, p in enumerate(prompts)])
    return {"plain": [r.token_ids for r in plain], "spec": [r.token_ids for r in spec],
            "accepted": sum(r.accepted_tokens for r in spec), "drafted": sum(r.draft_tokens for r in spec)}


def _worker(rank: int, world: int, port: int, results) -> None:
    torch.set_num_threads(1)
    try:
        groups = init_group(rank, world, f"127.0.0.1:{port}", timeout=timedelta(seconds=TIMEOUT_S))
        model = shard_model(_load(), rank, world, groups.compute)
        if rank:
            follow(model, groups.meta)
            results.put((rank, "done", None))
            return
        driver = TensorParallelDriver(model, groups.meta)
        try:
            out = {"kv_heads": driver.config.num_key_value_heads, "ragged": _ragged_forwards(driver),
                   **_generate(driver),
                   "profile": len(profile_sps(driver, batch_tokens=(1, 4), context=16, repeats=1))}
        finally:
            driver.close()
        results.put((rank, "ok", out))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs() -> tuple[dict, dict]:
    """(rank 0's results at TP=2, the same computed unsharded here)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, WORLD, port, results), daemon=True) for r in range(WORLD)]
    try:
        for p in procs:
            p.start()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the two ranks use the other CPUs; oversubscribed OpenMP crawls
        try:
            ref = _load()
            reference = {"ragged": _ragged_forwards(ref), **_generate(ref)}
        finally:
            torch.set_num_threads(threads)
        got = {}
        for _ in procs:
            try:
                rank, status, payload = results.get(timeout=TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"no answer from the ranks within {TIMEOUT_S} s (got {sorted(got)})")
            if status == "error":
                pytest.fail(f"rank {rank} failed:\n{payload}")
            got[rank] = payload
        for p in procs:
            p.join(timeout=30)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        return got[0], reference
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


def test_tp2_ragged_forward_equals_unsharded(runs):
    tp, ref = runs
    assert tp["kv_heads"] == 1  # the local config: rank 0's cache holds one of the two KV heads
    for (logits, feats), (ref_logits, ref_feats) in zip(tp["ragged"], ref["ragged"], strict=True):
        torch.testing.assert_close(torch.from_numpy(logits), torch.from_numpy(ref_logits), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.from_numpy(feats), torch.from_numpy(ref_feats), atol=1e-5, rtol=1e-5)


def test_tp2_engine_greedy_equals_tp1(runs):
    tp, ref = runs
    assert [len(t) for t in ref["plain"]] == [MAX_TOKENS] * 3
    assert tp["plain"] == ref["plain"]
    assert tp["spec"] == ref["spec"] == ref["plain"]
    assert 0 < tp["accepted"] < tp["drafted"]  # the oracle's drafts were both accepted and rolled back
    assert tp["profile"] == 2  # profile_sps runs through the driver too


def test_shard_model_refuses_indivisible_heads():
    model = _load()
    with pytest.raises(ValueError, match="6 attention heads over 4 ranks"):
        shard_model(model, 0, 4)
    assert model.config.num_attention_heads == 6  # refused before touching anything
    with pytest.raises(ValueError, match="rank 2 outside"):
        shard_model(model, 2, 2)

"""Engine: cached incremental decoding equals full recompute; features; admission; bad input."""

from __future__ import annotations

import pytest
import torch

from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.errors import CapacityError, InvalidRequestError
from services.layers import RaggedLayout
from services.types import DraftBlock, SamplingParams
from tests.conftest import VOCAB, full_forward, make_engine, random_prompts
from verifier_worker.kv_cache import KVCache


def test_incremental_decoding_equals_full_recompute(tiny_model):
    prompt = random_prompts(3)[2]
    out = full_forward(tiny_model, prompt + [3] * 10)
    cache = KVCache(tiny_model.config, 2, 64, torch.float32, torch.device("cpu"))
    cache.allocate("other")
    cache.append("other", 7)  # a neighbour in slot 0
    slot = cache.allocate("x")
    tokens = prompt + [3] * 10
    for t, token in enumerate(tokens):  # one token per forward
        _, start = cache.append("x", 1)
        step = tiny_model(torch.tensor([token]), torch.tensor([t]), RaggedLayout([slot], [start], [1]),
                          cache.k, cache.v, torch.tensor([0]))
        torch.testing.assert_close(step.logits[0], out.logits[t], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(step.features[0], out.features[t], atol=1e-5, rtol=1e-5)


def test_greedy_engine_output_is_argmax_of_full_forward(tiny_model):
    prompt = random_prompts(2)[1]
    result = InProcessRouter(make_engine(tiny_model), policy=Policy.NONE).generate(
        [GenerationRequest("a", prompt, SamplingParams(max_tokens=20))])[0]
    logits = full_forward(tiny_model, prompt + result.token_ids).logits
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == result.token_ids


def _collect_features(engine, rid, prompt, drafts):
    """Prefill, then one verify cycle per draft block; features stitched by position."""
    engine.add_request(rid, prompt, SamplingParams(max_tokens=40))
    rows: dict[int, torch.Tensor] = {}
    outs = []
    while engine.has_work() or drafts:
        if not engine.has_work():
            engine.submit(rid, drafts.pop(0))
        for out in engine.step():
            outs.append(out)
            for k in range(out.features.shape[0]):
                rows[out.feature_start + k] = out.features[k]
    return outs, rows


def test_features_of_committed_positions(tiny_model):
    engine = make_engine(tiny_model, max_batch_tokens=8)  # prompt of 21 tokens → 3 prefill chunks
    prompt = random_prompts(3)[2]
    outs, rows = _collect_features(engine, "a", prompt, [DraftBlock([4, 4, 4]), DraftBlock([]),
                                                         DraftBlock([9, 1])])
    tokens = engine.tokens("a")
    assert sorted(rows) == list(range(len(tokens) - 1))  # every committed position except the anchor
    full = full_forward(tiny_model, tokens).features
    torch.testing.assert_close(torch.stack([rows[p] for p in sorted(rows)]), full[: len(tokens) - 1],
                               atol=1e-5, rtol=1e-5)
    assert [o.num_drafts for o in outs if o.kind and o.kind != "first"] == [3, 0, 2]


def test_chunked_prefill_equals_one_shot(tiny_model):
    prompt = random_prompts(4)[3]  # 30 tokens
    firsts = []
    for budget in (4, 7, 64):
        engine = make_engine(tiny_model, max_batch_tokens=budget)
        engine.add_request("a", prompt, SamplingParams(max_tokens=4))
        while engine.has_work():
            engine.step()
        firsts.append(engine.tokens("a")[-1])
    assert len(set(firsts)) == 1


def test_admission_control(tiny_model):
    engine = make_engine(tiny_model, num_slots=1, max_len=32, max_waiting=2)
    with pytest.raises(InvalidRequestError, match="exceeds the context limit of 32"):
        engine.add_request("long", list(range(1, 30)), SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request("oov", [1, 10_000], SamplingParams(max_tokens=4))
    for rid in "abc":  # one for the free slot, two for the queue
        engine.add_request(rid, [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(CapacityError, match="queue is full"):
        engine.add_request("d", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("a", [1], SamplingParams(max_tokens=4))
    engine.step()  # "a" takes the only slot; "b" and "c" wait
    assert (engine.num_running, engine.num_waiting) == (1, 2)
    with pytest.raises(CapacityError, match="queue is full"):
        engine.add_request("d", [1, 2, 3], SamplingParams(max_tokens=4))
    engine.release("a")
    engine.step()
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    assert engine.cache.usage().slots_used == 1


def test_bad_drafts_are_refused_and_change_nothing(tiny_model):
    engine = make_engine(tiny_model)
    with pytest.raises(InvalidRequestError, match="not ready"):
        engine.submit("nobody", DraftBlock([1]))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=8, temperature=1.0, seed=3))
    with pytest.raises(InvalidRequestError, match="not ready"):
        engine.submit("a", DraftBlock([1]))  # still prefilling
    engine.step()
    before = (engine.tokens("a"), engine.cache.length("a"))
    bad = [
        DraftBlock([1, 99_999]),
        DraftBlock([1, 2], q_ids=torch.tensor([[1, 5], [3, 4]]), q_probs=torch.tensor([[0.5, 0.5], [0.5, 0.5]])),
        DraftBlock([1, 2], q_ids=torch.tensor([[1, 5]]), q_probs=torch.tensor([[0.5, 0.5]])),
    ]
    for block in bad:
        with pytest.raises(InvalidRequestError):
            engine.submit("a", block)
    assert (engine.tokens("a"), engine.cache.length("a")) == before
    engine.submit("a", DraftBlock([1]))
    with pytest.raises(InvalidRequestError, match="in flight"):
        engine.submit("a", DraftBlock([1]))


def test_verify_length_is_cut_to_the_slot(tiny_model):
    engine = make_engine(tiny_model, max_len=12)
    engine.add_request("a", list(range(1, 9)), SamplingParams(max_tokens=4))
    engine.step()
    assert engine.submit("a", DraftBlock([1, 2, 3, 4, 5, 6])) == 3  # 8 cached + anchor + 3 drafts = 12
    engine.step()
    assert engine.cache.length("a") <= 12


def test_seeded_sampling_is_reproducible(tiny_model):
    reqs = [GenerationRequest(f"s{i}", p, SamplingParams(max_tokens=16, temperature=1.0, top_k=20, seed=11))
            for i, p in enumerate(random_prompts(3))]
    runs = [InProcessRouter(make_engine(tiny_model), policy=Policy.NONE).generate(reqs) for _ in range(2)]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
    assert len({tuple(r.token_ids) for r in runs[0]}) == 3


def test_prefill_chunks_and_verify_items_share_a_step(tiny_model):
    engine = make_engine(tiny_model, max_batch_tokens=6)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=8))
    engine.step()
    engine.submit("a", DraftBlock([4, 5]))
    engine.add_request("b", random_prompts(3)[2], SamplingParams(max_tokens=8))  # 21 tokens: 4 chunks
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].num_drafts == 2 and outs["a"].emitted
    assert outs["b"].emitted == [] and outs["b"].features.shape[0] == 6 - 3  # budget left after the verify item


def test_dense_forward_equals_cached_forward(tiny_model):
    prompts = [random_prompts(3)[2][:12], random_prompts(3)[1][:12]]
    dense = tiny_model.forward_dense(torch.tensor(prompts))
    for b, prompt in enumerate(prompts):
        ragged = full_forward(tiny_model, prompt)
        torch.testing.assert_close(dense.logits[b], ragged.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dense.features[b], ragged.features, atol=1e-5, rtol=1e-5)


def test_a_request_that_waits_for_a_slot_reports_its_wait_apart_from_its_speed(tiny_model):
    """With one KV slot, the second request is first scheduled only after the first has finished: that wait is
    its queued_s, not part of the elapsed_s its tokens_per_s is measured over."""
    params = SamplingParams(max_tokens=12)
    reqs = [GenerationRequest(f"r{i}", p, params) for i, p in enumerate(random_prompts(2))]
    first, second = InProcessRouter(make_engine(tiny_model, num_slots=1), policy=Policy.NONE).generate(reqs)
    assert second.queued_s >= first.elapsed_s > 0
    assert first.queued_s < second.queued_s
    assert second.tokens_per_s == len(second.token_ids) / second.elapsed_s


def test_generation_past_1024_positions_is_exact_plain_and_speculative(tiny_model):
    """Target v2 serves a 2048-position context: a request whose prompt and output cross position 1024 decodes as
    the full forward says, plainly and with drafts (n-gram, greedy), through chunked prefill."""
    from drafter_worker.ngram import NgramProposer

    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(1, VOCAB, (1010,), generator=g).tolist()
    req = [GenerationRequest("long", prompt, SamplingParams(max_tokens=40))]
    kw = {"num_slots": 1, "max_len": 1100, "max_batch_tokens": 256}
    plain = InProcessRouter(make_engine(tiny_model, **kw), policy=Policy.NONE).generate(req)[0]
    assert len(prompt) + len(plain.token_ids) > 1024
    logits = full_forward(tiny_model, prompt + plain.token_ids).logits
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == plain.token_ids
    spec = InProcessRouter(make_engine(tiny_model, **kw), NgramProposer(), Policy.FIXED, 4).generate(req)[0]
    assert spec.token_ids == plain.token_ids and spec.cycles < len(plain.token_ids)

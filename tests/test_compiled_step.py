"""The compiled step: one warmed graph for every step, the eager forward's numbers, bf16 speculation bit-exact."""

from __future__ import annotations

import copy

import pytest
import torch

from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.compiled_step import CompiledStep
from services.layers import RaggedLayout
from services.types import SamplingParams
from tests.conftest import VOCAB, make_engine, make_model, random_prompts, unique_graphs
from tests.drafters import OracleProposer
from tests.test_speculative_greedy import _bf16_linears_row_invariant


def _requests() -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=30 - 3 * i))
            for i, p in enumerate(random_prompts(4))]


@pytest.fixture(scope="module")
def bf16_model():
    return make_model(taps=(0, 1)).to(torch.bfloat16)


@pytest.fixture(scope="module")
def compiled_plain(bf16_model):
    """Plain greedy through a compiled engine; also how many graphs it compiled after its warm-up."""
    before = unique_graphs()
    engine = make_engine(bf16_model, compile=True, num_slots=3, max_batch_tokens=10)
    graphs = unique_graphs()
    assert graphs == before + 1  # the warm-up compiled the one graph (and the counter counts)
    results = InProcessRouter(engine, policy=Policy.NONE).generate(_requests())
    return results, unique_graphs() - graphs


def test_every_step_runs_the_warmed_graph(compiled_plain):
    """Chunked prefill, decoding 1..3 requests, a long chunk beside decodes: none compiles a new graph."""
    _, new_graphs = compiled_plain
    assert new_graphs == 0


def test_compiled_bf16_speculation_is_bit_exact(bf16_model, compiled_plain):
    if not _bf16_linears_row_invariant():
        pytest.skip("this CPU's bf16 GEMM gives a row different bits at different row counts")
    base, _ = compiled_plain
    answers = {r.request_id: r.prompt_ids + r.token_ids for r in base}
    engine = make_engine(bf16_model, compile=True, num_slots=3, max_batch_tokens=10)
    spec = InProcessRouter(engine, OracleProposer(answers, VOCAB), Policy.FIXED, 5).generate(_requests())
    assert [r.token_ids for r in spec] == [r.token_ids for r in base]
    assert sum(r.accepted_tokens for r in spec) > 0


@pytest.mark.parametrize("buckets", [False, True], ids=["exact-sizes", "cuda-graph-buckets"])
def test_compiled_forward_agrees_with_eager_in_fp32(buckets):
    """Also with the sizes padded to the power-of-two buckets CUDA graphs replay (rows, blocks, keys, logit rows
    of 23 → 32, 3 → 4, 64 → 64, ...): the padding adds nothing and drops nothing."""
    model = make_model(taps=(1,))
    model.prepare_for_serving()
    step = CompiledStep(model, max_len=128 if buckets else 64, num_slots=3, buckets=buckets)
    cfg = model.config
    shape = (cfg.num_hidden_layers, 3, cfg.num_key_value_heads, 128 if buckets else 64, cfg.head_dim)
    layouts = [RaggedLayout([2, 0], [0, 0], [7, 12]), RaggedLayout([0, 1, 2], [12, 0, 7], [3, 5, 1]),
               RaggedLayout([1], [5], [1])]
    if buckets:  # keys past 64: the key bucket grows to 128
        layouts.append(RaggedLayout([0, 2], [15, 8], [60, 3]))
    caches = {}
    for name, fn in (("eager", model), ("compiled", step)):
        k, v = torch.zeros(shape), torch.zeros(shape)
        g = torch.Generator().manual_seed(3)
        outs = []
        for layout in layouts:
            n = sum(layout.lens)
            ids = torch.randint(1, VOCAB, (n,), generator=g)
            pos = torch.cat([torch.arange(s, s + m) for s, m in zip(layout.starts, layout.lens, strict=True)])
            with torch.inference_mode():
                out = fn(ids, pos, layout, k, v, torch.arange(n))
            outs.append((out.logits, out.features))
        caches[name] = (outs, k)
    for (el, ef), (cl, cf) in zip(caches["eager"][0], caches["compiled"][0], strict=True):
        torch.testing.assert_close(cl, el, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cf, ef, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches["compiled"][1], caches["eager"][1], atol=1e-5, rtol=1e-5)


def test_a_tensor_parallel_driver_is_refused():
    class NotACausalLM:
        config = make_model().config
        dtype, device = torch.float32, torch.device("cpu")

    with pytest.raises(ValueError, match="compile needs a CausalLM"):
        make_engine(copy.copy(NotACausalLM()), compile=True)

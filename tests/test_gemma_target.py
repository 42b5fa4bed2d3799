"""Gemma 3 text targets: logits, taps, cached decoding and speculation equal transformers' on a tiny random
Gemma3ForCausalLM (odd sizes, a window of 5 that bites); unsupported Gemma fields are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from drafter_worker.ngram import NgramProposer
from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.attention import AttentionPlan, attend, attend_per_request
from services.compiled_step import CompiledStep
from services.errors import ModelLoadError
from services.gemma import scale_embeddings
from services.layers import RaggedLayout
from services.loader import load_model
from services.model_config import ModelConfig
from services.types import SamplingParams
from tests.conftest import full_forward, make_engine, unique_graphs
from tests.drafters import RandomProposer

VOCAB, WINDOW = 97, 5
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_hidden_layers=5, num_attention_heads=3,
    num_key_value_heads=1, head_dim=20, query_pre_attn_scalar=24, sliding_window=WINDOW, layer_types=LAYER_TYPES,
    max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=0,
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}},
)


def save_gemma(path, **extra) -> transformers.Gemma3ForCausalLM:
    config = transformers.Gemma3TextConfig(**{**CONFIG, **extra}, attn_implementation="eager")
    torch.manual_seed(0)
    ref = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # random everything, the (1 + w) norms included, so every tensor matters
        for _, p in ref.named_parameters():
            p.normal_(0.0, 0.2)
    ref.save_pretrained(path)
    return ref


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(HF reference, its directory, ours loaded in fp32 with taps 1, 3 and L)."""
    path = tmp_path_factory.mktemp("gemma")
    ref = save_gemma(path)
    return ref, path, load_model(path, dtype="float32", tap_layers=(1, 3, 5))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (23, 4, 13)]


@pytest.mark.parametrize("extra", [{}, {"final_logit_softcapping": 3.0}, {"attention_bias": True}],
                         ids=["gemma3", "final-softcap", "attention-bias"])
def test_logits_match_transformers(tmp_path, extra):
    ref = save_gemma(tmp_path, **extra)
    ours = load_model(tmp_path, dtype="float32")
    ids = torch.randint(0, VOCAB, (40,))  # 8 windows long
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
        dense = ours.forward_dense(ids[None]).logits[0]
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(full_forward(ours, ids).logits, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dense, expected, atol=1e-4, rtol=1e-4)


def test_the_window_bites(gemma, tmp_path):
    """The same weights with a window wider than the prompt give other logits past position 5."""
    ref, path, _ = gemma
    raw = json.loads((path / "config.json").read_text())
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "sliding_window": 1000}))
    ids = torch.randint(0, VOCAB, (30,))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    wide = full_forward(load_model(tmp_path, dtype="float32"), ids).logits
    torch.testing.assert_close(wide[:WINDOW], expected[:WINDOW], atol=1e-4, rtol=1e-4)
    assert (wide[WINDOW:] - expected[WINDOW:]).abs().max() > 1e-2


def test_taps_match_transformers_hidden_states(gemma):
    ref, _, ours = gemma
    ids = torch.randint(0, VOCAB, (19,))
    with torch.no_grad():
        out = ref.model(ids[None], output_hidden_states=True)
    d = CONFIG["hidden_size"]
    expected = torch.cat([out.hidden_states[2][0], out.hidden_states[4][0], out.last_hidden_state[0]], -1)
    features = full_forward(ours, ids).features  # [T, 3d]: layers 1 and 3, then the final normed hidden (tap L)
    torch.testing.assert_close(features, expected, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        dense = ours.forward_dense(ids[None])
    torch.testing.assert_close(dense.features[0], expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dense.hidden[0], expected[:, 2 * d :], atol=1e-4, rtol=1e-4)


def test_transformers_4_config_dialect():
    """rope_theta / rope_local_base_freq / rope_scaling / sliding_window_pattern read as HF converts them."""
    raw = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **CONFIG, "layer_types": None,
           "rope_parameters": None, "rope_theta": 1000.0, "rope_local_base_freq": 50.0, "sliding_window_pattern": 3,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    raw = {k: v for k, v in raw.items() if v is not None}
    hf = transformers.Gemma3TextConfig(**raw)
    cfg = ModelConfig.from_dict(raw)
    assert cfg.gemma.sliding_layers == tuple(t == "sliding_attention" for t in hf.layer_types)
    assert cfg.gemma.sliding_layers == (True, True, False, True, True)
    full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rope.factor) == (full["rope_theta"], "linear", 8.0)
    assert (cfg.gemma.local_rope.theta, cfg.gemma.local_rope.rope_type) == (local["rope_theta"], "default")
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.max_context == 256


def test_embedding_scale_rounds_as_transformers():
    emb = transformers.models.gemma3.modeling_gemma3.Gemma3TextScaledWordEmbedding(50, 3072, 0, 3072**0.5)
    emb = emb.to(torch.bfloat16)
    ids = torch.arange(50)
    with torch.no_grad():
        assert torch.equal(scale_embeddings(torch.nn.functional.embedding(ids, emb.weight), 3072), emb(ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_one_call_equals_per_request(dtype):
    """Prefill chunks, verify items and decodes in one call, each row over keys (p - 5, p] only."""
    slots, starts, lens = [2, 0, 1, 3], [64, 7, 130, 0], [8, 1, 5, 37]
    g = torch.Generator().manual_seed(0)
    n = sum(lens)
    q, k, v = (torch.randn(n, h, 16, generator=g).to(dtype) for h in (4, 2, 2))
    cache = torch.randn(2, 4, 2, 200, 16, generator=g).to(dtype)
    ref_cache = cache.clone()
    plan = AttentionPlan.build(slots, starts, lens, q.device, 200).windowed(WINDOW)
    out = attend(q, k, v, plan, cache[0], cache[1])
    ref = attend_per_request(q, k, v, slots, starts, lens, ref_cache[0], ref_cache[1], window=WINDOW)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    full = attend_per_request(q, k, v, slots, starts, lens, ref_cache[0].clone(), ref_cache[1].clone())
    assert (full - ref).abs().max() > 0.1  # the window changed the outputs


def _requests(max_tokens: int = 24) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(_prompts())]


@pytest.fixture(scope="module")
def plain(gemma):
    _, _, ours = gemma
    engine = make_engine(ours, num_slots=2, max_len=64, max_batch_tokens=7)  # prompts arrive in chunks
    return InProcessRouter(engine, policy=Policy.NONE).generate(_requests())


def test_engine_greedy_equals_transformers_generate(gemma, plain):
    ref, _, _ = gemma
    for request, result in zip(_requests(), plain, strict=True):
        with torch.no_grad():
            hf = ref.generate(torch.tensor([request.prompt_ids]), max_new_tokens=24, do_sample=False,
                              attention_mask=torch.ones(1, len(request.prompt_ids), dtype=torch.long))
        assert result.token_ids == hf[0, len(request.prompt_ids):].tolist(), request.request_id
    assert len({tuple(r.token_ids) for r in plain}) == len(plain)


@pytest.mark.parametrize("drafter", ["ngram", "random"])
def test_speculative_greedy_equals_plain(gemma, plain, drafter):
    _, _, ours = gemma
    proposer = NgramProposer() if drafter == "ngram" else RandomProposer(VOCAB)
    engine = make_engine(ours, num_slots=2, max_len=64, max_batch_tokens=7)
    spec = InProcessRouter(engine, proposer, Policy.FIXED, 4).generate(_requests())
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert sum(r.draft_tokens for r in spec) > 0


def test_compiled_step_agrees_with_eager(tmp_path):
    """The windowed mask is cut inside the graph: one warmed graph serves prefill chunks, verifies and decodes.
    Two layers, a windowed one and a global one: what the graph has to get right, at 2/5 of the compile time."""
    save_gemma(tmp_path, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    model = load_model(tmp_path, dtype="float32", tap_layers=(1,))
    model.prepare_for_serving()
    step = CompiledStep(model, max_len=64, num_slots=3)
    graphs = unique_graphs()
    cfg = model.config
    shape = (cfg.num_hidden_layers, 3, cfg.num_key_value_heads, 64, cfg.head_dim)
    layouts = [RaggedLayout([2, 0], [0, 0], [7, 12]), RaggedLayout([0, 1, 2], [12, 0, 7], [3, 5, 1]),
               RaggedLayout([1], [5], [1]), RaggedLayout([0, 1], [15, 6], [20, 4])]
    results = {}
    for name, fn in (("eager", model), ("compiled", step)):
        g = torch.Generator().manual_seed(3)
        outs = []
        k, v = torch.zeros(shape), torch.zeros(shape)  # the cache outside inference mode, the step's ids inside,
        with torch.inference_mode():  # as the engine makes them (a dispatch-key guard would recompile otherwise)
            for layout in layouts:
                n = sum(layout.lens)
                ids = torch.randint(1, VOCAB, (n,), generator=g)
                pos = torch.cat([torch.arange(s, s + m) for s, m in zip(layout.starts, layout.lens, strict=True)])
                outs.append(fn(ids, pos, layout, k, v, torch.arange(n)))
        results[name] = outs
    for e, c in zip(results["eager"], results["compiled"], strict=True):
        torch.testing.assert_close(c.logits, e.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c.features, e.features, atol=1e-5, rtol=1e-5)
    assert unique_graphs() == graphs


REFUSALS = {
    "attn_logit_softcapping": ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    "activation": ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
    "layer-type": ({"layer_types": ["chunked_attention", *LAYER_TYPES[1:]]}, "'chunked_attention'"),
    "layer-count": ({"layer_types": LAYER_TYPES[:4]}, "layer_types has 4 entries for 5 layers"),
    "window": ({"sliding_window": None}, "sliding_window=None"),
    "bidirectional": ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    "rope": ({"rope_parameters": {**CONFIG["rope_parameters"], "full_attention": {"rope_type": "yarn"}}},
             "rope type 'yarn'"),
    "multimodal": ({"architectures": ["Gemma3ForConditionalGeneration"]}, "Gemma3ForConditionalGeneration"),
    "gemma2": ({"architectures": ["Gemma2ForCausalLM"]}, "Gemma2ForCausalLM"),
    "gemma4": ({"architectures": ["Gemma4ForCausalLM"]}, "Gemma4ForCausalLM.*per-layer input embeddings"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_unsupported_gemma_fields_are_refused_by_name(gemma, tmp_path, case):
    _, path, _ = gemma
    change, message = REFUSALS[case]
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    raw = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(")):
        load_model(tmp_path, dtype="float32")

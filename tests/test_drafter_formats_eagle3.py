"""EAGLE-3 heads in the SpecForge / SafeAILab layout (`LlamaForCausalLMEagle3`), as vLLM and SGLang load them,
without downloads: a tiny random checkpoint with the format's names, a draft config of its own (Llama, no
q/k norms, its own MLP width, no rope_theta: 10000 while the target's is 1e6), a reduced draft vocabulary
(d2t, t2d), compared with a reference chain written here from the format's definition."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from drafter_worker.checkpoint import drafter_config, load_drafter
from drafter_worker.drafter import Drafter
from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.errors import ModelLoadError
from services.model import CausalLM
from services.sampling import logits_to_probs
from services.types import SamplingParams
from tests.chi2 import chisquare
from tests.conftest import full_forward, make_engine
from tests.draft_formats import (
    DH,
    HKV,
    LAYERS,
    TAPS,
    TARGET_CONFIG,
    D,
    H,
    V,
    assert_greedy_is_plain,
    norm_weight,
    rms,
    rope,
    tiny_target,
)

VD, FF_DRAFT, DRAFT_THETA, STEPS = 100, 80, 10000.0, 4


@pytest.fixture(scope="module")
def target() -> CausalLM:
    return tiny_target()


def vocab_map(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """SpecForge's rule: the Vd most frequent target ids, sorted → d2t offsets and the t2d mask."""
    freq = torch.rand(V, generator=torch.Generator().manual_seed(seed))
    used = freq.topk(VD).indices.sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(VD), t2d


def eagle3_tensors(seed: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return 0.3 * torch.randn(*shape, generator=g)

    d2t, t2d = vocab_map()
    return {"fc.weight": w(D, 3 * D) / math.sqrt(3), "norm.weight": norm_weight(g, D), "lm_head.weight": w(VD, D),
            "d2t": d2t, "t2d": t2d,
            "midlayer.input_layernorm.weight": norm_weight(g, D), "midlayer.hidden_norm.weight": norm_weight(g, D),
            "midlayer.post_attention_layernorm.weight": norm_weight(g, D),
            "midlayer.self_attn.q_proj.weight": w(H * DH, 2 * D),
            "midlayer.self_attn.k_proj.weight": w(HKV * DH, 2 * D),
            "midlayer.self_attn.v_proj.weight": w(HKV * DH, 2 * D), "midlayer.self_attn.o_proj.weight": w(D, H * DH),
            "midlayer.mlp.gate_proj.weight": w(FF_DRAFT, D), "midlayer.mlp.up_proj.weight": w(FF_DRAFT, D),
            "midlayer.mlp.down_proj.weight": w(D, FF_DRAFT)}


def write_eagle3(path, ids_key="nested", **overrides) -> dict[str, torch.Tensor]:
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": D,
              "intermediate_size": FF_DRAFT, "num_hidden_layers": 1, "num_attention_heads": H,
              "num_key_value_heads": HKV, "head_dim": DH, "rms_norm_eps": 1e-6, "vocab_size": V,
              "draft_vocab_size": VD, "max_position_embeddings": 64, "tie_word_embeddings": False}
    if ids_key == "nested":  # SpecForge/SGLang: output-of-layer ids
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(TAPS), "use_aux_hidden_state": True}
    elif ids_key == "top":  # vLLM: input-to-layer ids
        config["eagle_aux_hidden_state_layer_ids"] = [t + 1 for t in TAPS]
    config.update(overrides)
    tensors = eagle3_tensors()
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def reference_chain(t, embed, taps, ids, norm_before_residual=False, qk_norm=False):
    """Greedy drafts of a SpecForge EAGLE-3 head: rows (fc(taps_j), emb(ids[j+1])) at position j, causal; then
    draft rows (own pre-norm output, emb(x_k)) → tokens and peaks (max q over the target vocabulary)."""
    hot = torch.arange(len(t["d2t"])) + t["d2t"]
    theta = TARGET_CONFIG["rope_theta"] if qk_norm else DRAFT_THETA  # DeepSpec's config is the target's

    def heads(m, n, norm):
        m = m.unflatten(-1, (n, DH))
        return rms(m, t[f"midlayer.self_attn.{norm}.weight"]) if qk_norm else m
    keys, values = [], []

    def rows(hidden, tokens, positions):
        e = embed[torch.tensor(tokens)]
        hn = rms(hidden, t["midlayer.hidden_norm.weight"])
        residual = hn if norm_before_residual else hidden
        x = torch.cat([rms(e, t["midlayer.input_layernorm.weight"]), hn], -1)  # [n, 2d]
        pos = torch.tensor(positions)
        q = rope(heads(x @ t["midlayer.self_attn.q_proj.weight"].T, H, "q_norm"), pos, theta)
        keys.append(rope(heads(x @ t["midlayer.self_attn.k_proj.weight"].T, HKV, "k_norm"), pos, theta))
        values.append((x @ t["midlayer.self_attn.v_proj.weight"].T).unflatten(-1, (HKV, DH)))
        k, v = (torch.cat(c).repeat_interleave(H // HKV, 1) for c in (keys, values))
        first = k.shape[0] - len(positions)
        causal = torch.arange(k.shape[0])[None] <= (first + torch.arange(len(positions)))[:, None]  # [n, m]
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(DH)
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v).flatten(1)
        y = residual + attn @ t["midlayer.self_attn.o_proj.weight"].T
        m = rms(y, t["midlayer.post_attention_layernorm.weight"])
        gate, up = F.silu(m @ t["midlayer.mlp.gate_proj.weight"].T), m @ t["midlayer.mlp.up_proj.weight"].T
        return y + (gate * up) @ t["midlayer.mlp.down_proj.weight"].T

    p = taps.shape[0]
    h = rows(taps @ t["fc.weight"].T, ids[1 : p + 1], list(range(p)))[-1]
    tokens, peaks = [], []
    for k in range(STEPS):
        full = torch.full((V,), float("-inf"))
        full[hot] = rms(h, t["norm.weight"]) @ t["lm_head.weight"].T
        tokens.append(int(full.argmax()))
        peaks.append(float(full.softmax(-1).max()))
        if k + 1 < STEPS:
            h = rows(h[None], [tokens[-1]], [p + k])[-1]
    return tokens, peaks


def first_block(model, taps, ids):
    drafter = Drafter(model)
    drafter.commit("r", 0, taps)
    return drafter.propose({"r": ids}, STEPS, {"r": SamplingParams(temperature=0.0)})["r"]


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_eagle3_chain_matches_the_reference(tmp_path, target, norm_before_residual):
    tensors = write_eagle3(tmp_path / "e", norm_before_residual=norm_before_residual)
    model, _ = load_drafter(tmp_path / "e", target, "float32")
    assert model.config.intermediate_size == FF_DRAFT and not model.config.qk_norm  # the draft's own config
    assert model.config.rope.theta == DRAFT_THETA and model.config.max_position_embeddings == 256  # target's
    g = torch.Generator().manual_seed(5)
    taps = torch.randn(11, len(TAPS) * D, generator=g)
    ids = torch.randint(4, 300, (12,), generator=g).tolist()
    block = first_block(model, taps, ids)
    tokens, peaks = reference_chain(tensors, target.model.embed_tokens.weight.detach(), taps, ids,
                                    norm_before_residual)
    assert block.tokens == tokens and all(t in (torch.arange(VD) + tensors["d2t"]).tolist() for t in tokens)
    # the drafter's GEMMs are oneDNN's on packed weights (services/packed_linear.py), the reference's MKL's:
    # the same sums in another order, through STEPS chained steps
    torch.testing.assert_close(torch.tensor(block.peaks), torch.tensor(peaks), atol=1e-4, rtol=1e-4)


def test_the_reference_tells_the_target_rope_apart(tmp_path, target):
    """Reading the target's RoPE base (1e6) instead of the draft's (10000) must fail the parity test."""
    tensors = write_eagle3(tmp_path / "e", rope_theta=1e6)
    model, _ = load_drafter(tmp_path / "e", target, "float32")
    g = torch.Generator().manual_seed(5)
    taps, ids = torch.randn(11, len(TAPS) * D, generator=g), torch.randint(4, 300, (12,), generator=g).tolist()
    _, peaks = reference_chain(tensors, target.model.embed_tokens.weight.detach(), taps, ids)
    assert not torch.allclose(torch.tensor(first_block(model, taps, ids).peaks), torch.tensor(peaks), atol=1e-5)


@pytest.mark.parametrize(("ids_key", "convention", "taps"), [
    ("nested", "auto", TAPS), ("top", "auto", TAPS), (None, "auto", (1, LAYERS // 2 - 1, LAYERS - 4)),
    ("nested", "input", tuple(t - 1 for t in TAPS)), ("top", "output", tuple(t + 1 for t in TAPS)),
])
def test_layer_id_conventions_become_dspark_taps(tmp_path, ids_key, convention, taps):
    write_eagle3(tmp_path / "e", ids_key)
    assert drafter_config(tmp_path / "e", "auto", LAYERS, convention).tap_layers == taps


def test_greedy_with_a_reduced_vocabulary_head_is_plain_greedy(tmp_path, target):
    write_eagle3(tmp_path / "e")
    assert_greedy_is_plain(target, load_drafter(tmp_path / "e", target, "float32")[0], STEPS)


def _corrupt_d2t(t, c):
    t["d2t"] = t["d2t"].flip(0)


@pytest.mark.parametrize(("edit", "message"), [
    (_corrupt_d2t, "strictly increasing"),
    (lambda t, c: t.update({"d2t": t["d2t"] + 400}), "outside the target vocabulary"),
    (lambda t, c: t.update({"t2d": ~t["t2d"]}), "t2d does not mark"),
    (lambda t, c: t.pop("d2t"), "missing \\['d2t'\\]"),
    (lambda t, c: t.update({"midlayer.extra.weight": torch.zeros(2)}), "wrong shapes|unexpected"),
    (lambda t, c: t.update({"lm_head.weight": torch.zeros(VD + 1, D)}), "wrong shapes: lm_head.weight"),
    (lambda t, c: c.update({"num_hidden_layers": 2}), "of 2 layers"),
    (lambda t, c: c.update({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 9]}}), "outside the target"),
])
def test_inconsistent_eagle3_checkpoints_fail_at_load(tmp_path, target, edit, message):
    tensors = write_eagle3(tmp_path / "e")
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, str(tmp_path / "e" / "model.safetensors"))
    (tmp_path / "e" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        load_drafter(tmp_path / "e", target, "float32")


@pytest.mark.slow
def test_sampling_with_a_reduced_vocabulary_head_keeps_the_target_distribution(tmp_path, target):
    """q is 0 outside the draft vocabulary; the 2nd and 3rd sampled tokens still follow the target (χ²)."""
    write_eagle3(tmp_path / "e")
    model, _ = load_drafter(tmp_path / "e", target, "float32")
    params, prompt, n = {"temperature": 0.9, "top_k": 6}, [5, 17, 42], 2000
    engine = make_engine(target, num_slots=64, max_len=16, max_batch_tokens=512, max_waiting=4096)
    requests = [GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=3, seed=i, **params)) for i in range(n)]
    results = InProcessRouter(engine, Drafter(model, seed=1), Policy.FIXED, 2).generate(requests)
    assert sum(r.draft_tokens - r.accepted_tokens for r in results) > 0  # the residual path ran

    @torch.no_grad()
    def nxt(prefix):
        logits = full_forward(target, prefix).logits[-1:]
        return logits_to_probs(logits, torch.tensor([0.9]), torch.tensor([6]), torch.tensor([1.0]))[0]

    p1 = nxt(prompt)
    p2, p3 = torch.zeros(V), torch.zeros(V)
    for t1 in p1.nonzero()[:, 0].tolist():
        c2 = nxt([*prompt, t1])
        p2 += p1[t1] * c2
        for t2 in c2.nonzero()[:, 0].tolist():
            p3 += p1[t1] * c2[t2] * nxt([*prompt, t1, t2])
    for expected, observed in ((p2, [r.token_ids[1] for r in results]), (p3, [r.token_ids[2] for r in results])):
        counts = torch.bincount(torch.tensor(observed), minlength=V).double()
        keep = expected * n >= 5
        obs, exp = counts[keep].tolist(), (expected[keep] * n).tolist()
        if expected[~keep].sum() > 0:  # the sparse cells, pooled
            obs, exp = [*obs, float(counts[~keep].sum())], [*exp, float(expected[~keep].sum() * n)]
        assert chisquare(obs, [e * sum(obs) / sum(exp) for e in exp]).pvalue > 1e-3


def test_deepspec_eagle3_with_qk_norms_and_five_taps_matches_its_reference(tmp_path, target):
    """DeepSpec's Qwen3Eagle3Model: layers.0.* names, q/k norms, full vocabulary, shipped embedding/head copies."""
    g = torch.Generator().manual_seed(4)
    t = {k.replace("midlayer.", "layers.0."): v for k, v in eagle3_tensors().items() if k not in ("d2t", "t2d")}
    taps5 = (0, 1, 3, 5, 6)
    t |= {"fc.weight": 0.3 * torch.randn(D, 5 * D, generator=g) / math.sqrt(5),
          "lm_head.weight": target.lm_head.weight.detach().clone(),
          "embed_tokens.weight": target.model.embed_tokens.weight.detach().clone(),
          "layers.0.self_attn.q_norm.weight": norm_weight(g, DH),
          "layers.0.self_attn.k_norm.weight": norm_weight(g, DH)}
    ff = TARGET_CONFIG["intermediate_size"]  # the target's MLP width: its config is the target's
    for name in ("gate_proj", "up_proj"):
        t[f"layers.0.mlp.{name}.weight"] = 0.3 * torch.randn(ff, D, generator=g)
    t["layers.0.mlp.down_proj.weight"] = 0.3 * torch.randn(D, ff, generator=g)
    (tmp_path / "e").mkdir()
    save_file(t, str(tmp_path / "e" / "model.safetensors"))
    config = {**TARGET_CONFIG, "architectures": ["Qwen3Eagle3Model"], "num_hidden_layers": 1,
              "draft_num_hidden_layers": 1, "num_target_layers": LAYERS, "target_layer_ids": list(taps5),
              "ttt_length": 7, "step_loss_decay": 0.8, "layer_types": ["full_attention"]}
    (tmp_path / "e" / "config.json").write_text(json.dumps(config))
    model, _ = load_drafter(tmp_path / "e", target, "float32")
    assert drafter_config(tmp_path / "e", "auto", LAYERS).tap_layers == taps5 and model.config.qk_norm
    gen = torch.Generator().manual_seed(5)
    taps = torch.randn(11, 5 * D, generator=gen)
    ids = torch.randint(4, 300, (12,), generator=gen).tolist()
    block = first_block(model, taps, ids)
    ref = {k.replace("layers.0.", "midlayer."): v for k, v in t.items()}
    ref |= {"d2t": torch.zeros(V, dtype=torch.long)}  # the full vocabulary: the identity map
    tokens, peaks = reference_chain(ref, target.model.embed_tokens.weight.detach(), taps, ids, qk_norm=True)
    assert block.tokens == tokens
    torch.testing.assert_close(torch.tensor(block.peaks), torch.tensor(peaks), atol=1e-5, rtol=1e-5)


def test_a_frequency_ranked_draft_vocabulary_keeps_the_full_heads_logits_on_its_tokens(target):
    """dspark's own EAGLE-3 drafters can draft over the Vd most frequent tokens (training/draft_vocab.py)."""
    from drafter_worker.checkpoint import build_draft_model
    from drafter_worker.config import DrafterConfig
    from training.draft_vocab import frequency_d2t, reduce_vocab

    full = build_draft_model(DrafterConfig("eagle3", "t", TAPS), target).eval()
    counts = torch.rand(V, generator=torch.Generator().manual_seed(1))
    d2t = frequency_d2t(counts, VD)
    hot = torch.arange(VD) + d2t
    assert set(hot.tolist()) == set(counts.topk(VD).indices.tolist())
    reduced = reduce_vocab(full, d2t)
    x = torch.randn(3, D)
    with torch.no_grad():
        a, b = full.logits(x), reduced.logits(x)
    assert b.shape == (3, VD)  # logits over the draft vocabulary, in draft-id order
    torch.testing.assert_close(b, a[:, hot])
    full_b = reduced.scatter_vocab(b)  # back over the target's vocabulary: −inf outside it
    torch.testing.assert_close(full_b[:, hot], a[:, hot])
    assert bool(torch.isinf(full_b).sum(-1).eq(V - VD).all())
    assert reduced.to_target(torch.arange(VD)).tolist() == hot.tolist()
    assert reduced.draft_ids(hot).tolist() == list(range(VD))
    outside = torch.tensor(sorted(set(range(V)) - set(hot.tolist())))
    assert reduced.draft_ids(outside).eq(VD).all()

"""Released drafter formats, without downloads: each test writes a tiny random checkpoint with the format's
exact tensor names, shapes and config fields, loads it through the public path, and compares the first
draft block with a reference forward written here from the format's definition (not from dspark's drafter
modules). Odd sizes on purpose: head_dim ≠ d / H, Hkv ≠ H, the mask id in the padded rows."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from drafter_worker.checkpoint import drafter_config, load_drafter
from drafter_worker.drafter import Drafter
from services.errors import ModelLoadError
from services.model import CausalLM
from services.types import SamplingParams
from tests.draft_formats import (
    BLOCK,
    DH,
    DRAFT_LAYERS,
    FF,
    HKV,
    LAYERS,
    MASK,
    RANK,
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


@pytest.fixture(scope="module")
def target() -> CausalLM:
    return tiny_target()


def deepspec_tensors(target: CausalLM, markov: bool, seed: int = 1) -> dict[str, torch.Tensor]:
    """Every key of DeepSpec's Qwen3DSparkModel state dict (DeepSpec's `Qwen3DSparkModel`), random."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return 0.3 * torch.randn(*shape, generator=g)

    t = {"embed_tokens.weight": target.model.embed_tokens.weight.detach().clone(),
         "lm_head.weight": target.lm_head.weight.detach().clone(),
         "fc.weight": w(D, len(TAPS) * D) / math.sqrt(len(TAPS)), "hidden_norm.weight": norm_weight(g, D),
         "norm.weight": norm_weight(g, D)}
    for i in range(DRAFT_LAYERS):
        p = f"layers.{i}."
        t |= {p + "input_layernorm.weight": norm_weight(g, D), p + "post_attention_layernorm.weight": norm_weight(g, D),
              p + "self_attn.q_proj.weight": w(H * DH, D), p + "self_attn.k_proj.weight": w(HKV * DH, D),
              p + "self_attn.v_proj.weight": w(HKV * DH, D), p + "self_attn.o_proj.weight": w(D, H * DH),
              p + "self_attn.q_norm.weight": norm_weight(g, DH), p + "self_attn.k_norm.weight": norm_weight(g, DH),
              p + "mlp.gate_proj.weight": w(FF, D), p + "mlp.up_proj.weight": w(FF, D),
              p + "mlp.down_proj.weight": w(D, FF)}
    if markov:
        t |= {"markov_head.markov_w1.weight": w(V, RANK), "markov_head.markov_w2.weight": w(V, RANK),
              "confidence_head.proj.weight": w(1, D + RANK), "confidence_head.proj.bias": w(1)}
    return t


def write_deepspec(path, target, markov=True, shards=1, **config_overrides):
    path.mkdir(parents=True, exist_ok=True)
    config = {**TARGET_CONFIG, "architectures": ["Qwen3DSparkModel"], "num_hidden_layers": DRAFT_LAYERS,
              "num_target_layers": LAYERS, "block_size": BLOCK, "mask_token_id": MASK,
              "target_layer_ids": list(TAPS), "layer_types": ["full_attention"] * DRAFT_LAYERS, "num_anchors": 512,
              "enable_confidence_head": markov, "markov_rank": RANK if markov else 0}
    if markov:
        config |= {"confidence_head_with_markov": True, "markov_head_type": "vanilla"}
    (path / "config.json").write_text(json.dumps({**config, **config_overrides}))
    tensors = deepspec_tensors(target, markov)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
    else:  # HF save_pretrained's sharded layout
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s::shards]}
            save_file(part, str(path / file))
            weight_map |= dict.fromkeys(part, file)
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tensors


# ---- the reference, from the format's equations (DeepSpec's DSpark equations) ------------------------------
def reference_block(t, taps, anchor, markov=True, fill_in=False):
    """Greedy DSpark/DFlash block from context features taps [P, T·d] (positions 0..P−1) and the anchor at P
    → tokens [γ], peaks [γ], confidences [γ]. Fill-in layout: [anchor, MASK × γ], drafts from slots 1..γ."""
    p, slots = taps.shape[0], BLOCK + fill_in
    ctx = rms(taps @ t["fc.weight"].T, t["hidden_norm.weight"])  # [P, d]
    x = t["embed_tokens.weight"][torch.tensor([anchor] + [MASK] * (slots - 1))]  # [slots, d]
    cpos, bpos = torch.arange(p), torch.arange(p, p + slots)
    for i in range(DRAFT_LAYERS):
        w = {k.split(f"layers.{i}.", 1)[1]: v for k, v in t.items() if k.startswith(f"layers.{i}.")}
        h = rms(x, w["input_layernorm.weight"])

        def heads(m, n):
            return m.unflatten(-1, (n, DH))
        q = rope(rms(heads(h @ w["self_attn.q_proj.weight"].T, H), w["self_attn.q_norm.weight"]), bpos)
        kc = rope(rms(heads(ctx @ w["self_attn.k_proj.weight"].T, HKV), w["self_attn.k_norm.weight"]), cpos)
        kb = rope(rms(heads(h @ w["self_attn.k_proj.weight"].T, HKV), w["self_attn.k_norm.weight"]), bpos)
        k = torch.cat([kc, kb])  # [P+γ, Hkv, Dh]
        wv = w["self_attn.v_proj.weight"].T
        v = torch.cat([heads(ctx @ wv, HKV), heads(h @ wv, HKV)])
        k, v = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)  # GQA: head j reads kv j // 2
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(DH)  # non-causal: context and whole block
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).flatten(1)
        x = x + attn @ w["self_attn.o_proj.weight"].T
        m = rms(x, w["post_attention_layernorm.weight"])
        gate, up = F.silu(m @ w["mlp.gate_proj.weight"].T), m @ w["mlp.up_proj.weight"].T
        x = x + (gate * up) @ w["mlp.down_proj.weight"].T
    out = rms(x, t["norm.weight"])[1:] if fill_in else rms(x, t["norm.weight"])
    base = out @ t["lm_head.weight"].T  # U [γ, V]
    prev, tokens, peaks, conf = anchor, [], [], []
    for k in range(BLOCK):
        logits = base[k]
        if markov:
            e = t["markov_head.markov_w1.weight"][prev]
            logits = logits + e @ t["markov_head.markov_w2.weight"].T
            z = torch.cat([out[k], e]) @ t["confidence_head.proj.weight"][0] + t["confidence_head.proj.bias"][0]
            conf.append(float(torch.sigmoid(z)))
        prev = int(logits.argmax())
        tokens.append(prev)
        peaks.append(float(logits.softmax(-1).max()))
    return tokens, peaks, conf


def first_block(model, taps, context_ids):
    drafter = Drafter(model)
    drafter.commit("r", 0, taps)
    return drafter.propose({"r": context_ids}, BLOCK, {"r": SamplingParams(temperature=0.0)})["r"]


@pytest.mark.parametrize(("markov", "shards"), [(True, 1), (False, 1), (True, 2)],
                         ids=["dspark", "dflash", "dspark-sharded"])
def test_deepspec_block_matches_the_reference(tmp_path, target, markov, shards):
    tensors = write_deepspec(tmp_path / "d", target, markov, shards)
    model, _ = load_drafter(tmp_path / "d", target, "float32")
    cfg = drafter_config(tmp_path / "d")
    assert (str(cfg.method), cfg.tap_layers, cfg.block_size) == ("dspark" if markov else "dflash", TAPS, BLOCK)
    assert model.config.head_dim == DH and model.config.qk_norm  # the draft's own config, not d / H
    g = torch.Generator().manual_seed(5)
    taps = torch.randn(11, len(TAPS) * D, generator=g)
    ids = torch.randint(4, 300, (12,), generator=g).tolist()
    block = first_block(model, taps, ids)
    tokens, peaks, conf = reference_block(tensors, taps, ids[-1], markov)
    assert block.tokens == tokens
    torch.testing.assert_close(torch.tensor(block.peaks), torch.tensor(peaks), atol=1e-5, rtol=1e-5)
    if markov:
        torch.testing.assert_close(torch.tensor(block.confidences), torch.tensor(conf), atol=1e-5, rtol=1e-5)


def test_the_reference_tells_a_wrong_load_apart(tmp_path, target):
    """The parity test can fail: a checkpoint whose context norm is read as the final norm drafts otherwise."""
    tensors = write_deepspec(tmp_path / "d", target)
    model, _ = load_drafter(tmp_path / "d", target, "float32")
    model.context.hidden_norm.weight.data.copy_(tensors["norm.weight"])
    g = torch.Generator().manual_seed(5)
    taps = torch.randn(11, len(TAPS) * D, generator=g)
    ids = torch.randint(4, 300, (12,), generator=g).tolist()
    _, peaks, _ = reference_block(tensors, taps, ids[-1])
    assert not torch.allclose(torch.tensor(first_block(model, taps, ids).peaks), torch.tensor(peaks), atol=1e-5)


def test_shipped_copies_equal_to_the_target_are_shared_and_different_ones_kept(tmp_path, target):
    write_deepspec(tmp_path / "same", target)
    same, _ = load_drafter(tmp_path / "same", target, "float32")
    assert torch.equal(same.lm_head.weight, target.lm_head.weight)
    tensors = write_deepspec(tmp_path / "own", target)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 0.5
    save_file(tensors, str(tmp_path / "own" / "model.safetensors"))
    own, _ = load_drafter(tmp_path / "own", target, "float32")
    assert torch.equal(own.lm_head.weight, tensors["lm_head.weight"])


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t, c: t.pop("layers.1.self_attn.k_norm.weight"), "missing"),
    (lambda t, c: t.update({"fc.weight": torch.zeros(D, 2 * D)}), "wrong shapes: context.fc.weight"),
    (lambda t, c: t.update({"markov_head.extra.weight": torch.zeros(2)}), "unexpected tensor 'markov_head.extra"),
    (lambda t, c: c.update({"target_layer_ids": [-1, 3, 6]}), "embedding output"),
    (lambda t, c: c.update({"markov_head_type": "rnn"}), "markov_head_type 'rnn'"),
    (lambda t, c: c.pop("mask_token_id"), "lacks mask_token_id"),
])
def test_inconsistent_checkpoints_fail_at_load_naming_the_field(tmp_path, target, edit, message):
    tensors = write_deepspec(tmp_path / "d", target)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        load_drafter(tmp_path / "d", target, "float32")


def test_an_unknown_format_is_refused_with_what_is_known(tmp_path, target):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({**TARGET_CONFIG, "architectures": ["MysteryDraft"]}))
    with pytest.raises(ModelLoadError, match=r"MysteryDraft.*Qwen3DSparkModel"):
        load_drafter(tmp_path / "x", target, "float32")


@pytest.mark.parametrize("markov", [True, False], ids=["dspark", "dflash"])
def test_greedy_with_a_deepspec_drafter_is_plain_greedy(tmp_path, target, markov):
    write_deepspec(tmp_path / "d", target, markov)
    assert_greedy_is_plain(target, load_drafter(tmp_path / "d", target, "float32")[0], BLOCK)

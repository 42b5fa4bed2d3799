"""Released MTP modules, without downloads: DeepSeek-V3 (`model.layers.{L}.*`: MLA attention, grouped σ-routed
MoE, YaRN, FP8 block scales) and Qwen3-Next (`mtp.*`: gated attention, partial RoPE, (1 + w) norms, softmax MoE
with a gated shared expert). Each test writes a tiny random checkpoint with the format's names and config fields
(odd sizes: 3 heads, head dims ≠ d / H, r ≠ Dn + Dv), loads it through `load_drafter`, and compares drafts with a
reference forward written here from the format's definition (full per-head MLA keys, HF's de-interleaving RoPE,
per-token routing loops), not from dspark's modules. dspark cannot load MLA/MoE targets, so each module is paired
with the tiny Qwen3 target of `tests/draft_formats.py` (same width and vocabulary) tapping its final normed hidden."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from cluster.speculative_config import Speculative, apply
from drafter_worker.checkpoint import drafter_config, load_drafter, save_drafter
from drafter_worker.drafter import Drafter
from drafter_worker.formats import declared_method, detect
from services.errors import ModelLoadError
from services.model import CausalLM
from services.types import SamplingParams
from tests.conftest import full_forward
from tests.draft_formats import EPS, LAYERS, D, V, assert_greedy_is_plain, norm_weight, rms, tiny_target

P, Q = f"model.layers.{LAYERS}.", "mtp.layers.0."  # DeepSeek's module L = num_hidden_layers; Qwen3-Next's
HEADS, QR, KVR, NOPE, ROPE, VD, EXPERTS, WIDTH, BLOCK16 = 3, 24, 20, 12, 8, 10, 6, 40, (16, 16)
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}
DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": V, "hidden_size": D,
            "intermediate_size": 96, "moe_intermediate_size": WIDTH, "num_hidden_layers": LAYERS,
            "num_nextn_predict_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
            "n_shared_experts": 1, "n_routed_experts": EXPERTS, "routed_scaling_factor": 2.5, "kv_lora_rank": KVR,
            "q_lora_rank": QR, "qk_rope_head_dim": ROPE, "v_head_dim": VD, "qk_nope_head_dim": NOPE,
            "topk_method": "noaux_tc", "n_group": 3, "topk_group": 2, "num_experts_per_tok": 2,
            "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
            "max_position_embeddings": 256, "rms_norm_eps": EPS, "rope_theta": 10000, "rope_scaling": YARN,
            "attention_bias": False, "tie_word_embeddings": False}
QH, QKV, QDH, QROT, QEXPERTS, QSHARED = 4, 2, 24, 6, 5, 48
QWEN = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": V, "hidden_size": D,
        "intermediate_size": 96, "num_hidden_layers": LAYERS, "num_nextn_predict_layers": 1,
        "num_attention_heads": QH, "num_key_value_heads": QKV, "head_dim": QDH, "partial_rotary_factor": 0.25,
        "rope_theta": 1e6, "num_experts": QEXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": WIDTH,
        "shared_expert_intermediate_size": QSHARED, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "full_attention_interval": 4, "linear_num_value_heads": 4, "hidden_act": "silu",
        "max_position_embeddings": 256, "rms_norm_eps": EPS, "attention_bias": False, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def target() -> CausalLM:
    return tiny_target((LAYERS,))  # tap L: the final normed hidden


def _w(g, *shape):
    return 0.3 * torch.randn(*shape, generator=g) / math.sqrt(shape[-1] / 32)


def _expert(g, prefix, width):
    return {prefix + "gate_proj.weight": _w(g, width, D), prefix + "up_proj.weight": _w(g, width, D),
            prefix + "down_proj.weight": _w(g, D, width)}


def deepseek_tensors(target, seed=11) -> dict[str, torch.Tensor]:
    g, a, m = torch.Generator().manual_seed(seed), P + "self_attn.", P + "mlp."
    t = {P + "embed_tokens.weight": target.model.embed_tokens.weight.detach().clone(),
         P + "shared_head.head.weight": target.lm_head.weight.detach().clone(),
         P + "enorm.weight": norm_weight(g, D), P + "hnorm.weight": norm_weight(g, D),
         P + "eh_proj.weight": _w(g, D, 2 * D),
         P + "shared_head.norm.weight": norm_weight(g, D), P + "input_layernorm.weight": norm_weight(g, D),
         P + "post_attention_layernorm.weight": norm_weight(g, D),
         a + "q_a_proj.weight": _w(g, QR, D), a + "q_a_layernorm.weight": norm_weight(g, QR),
         a + "q_b_proj.weight": _w(g, HEADS * (NOPE + ROPE), QR), a + "kv_a_proj_with_mqa.weight": _w(g, KVR + ROPE, D),
         a + "kv_a_layernorm.weight": norm_weight(g, KVR), a + "kv_b_proj.weight": _w(g, HEADS * (NOPE + VD), KVR),
         a + "o_proj.weight": _w(g, D, HEADS * VD), m + "gate.weight": _w(g, EXPERTS, D),
         m + "gate.e_score_correction_bias": 0.1 * torch.randn(EXPERTS, generator=g)}
    for e in range(EXPERTS):
        t |= _expert(g, m + f"experts.{e}.", WIDTH)
    return t | _expert(g, m + "shared_experts.", WIDTH)


def quantize(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block e4m3 with the block's amax at 448 → (fp8 weight, scale_inv [⌈out/bo⌉, ⌈in/bi⌉])."""
    rows, cols = math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1])
    scale, q = torch.empty(rows, cols), torch.empty_like(w)
    for i in range(rows):
        for j in range(cols):
            cut = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            scale[i, j] = w[cut].abs().max() / 448
            q[cut] = w[cut] / scale[i, j]
    return q.to(torch.float8_e4m3fn), scale


def dequantized(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    w = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= scale[i, j]
    return w


def write(path, config, tensors, fp8=False, main=None) -> dict[str, torch.Tensor]:
    """config.json + model.safetensors; fp8: every projection of the block as e4m3 + weight_scale_inv in 16×16
    blocks (the reference then uses the dequantized weights). `main`: stand-ins of the main model's tensors."""
    path.mkdir(parents=True, exist_ok=True)
    stored, used = dict(tensors), dict(tensors)
    if fp8:
        config = {**config, "quantization_config": {"quant_method": "fp8", "weight_block_size": list(BLOCK16)}}
        for name in [n for n in tensors if ("self_attn." in n or "experts" in n) and "norm" not in n]:
            stored[name], stored[name + "_scale_inv"] = quantize(tensors[name], BLOCK16)
            used[name] = dequantized(stored[name], stored[name + "_scale_inv"], BLOCK16)
    (path / "config.json").write_text(json.dumps(config))
    save_file(stored | (main or {}), str(path / "model.safetensors"))
    return used


def main_stand_ins(g=None) -> dict[str, torch.Tensor]:
    g = g or torch.Generator().manual_seed(3)
    return {"model.embed_tokens.weight": torch.randn(V, D, generator=g), "model.norm.weight": torch.ones(D),
            "lm_head.weight": torch.randn(V, D, generator=g), "model.layers.0.mlp.gate.weight": torch.randn(4, D)}


# ---- the references, from the formats' equations ----------------------------------------------------------
def attention(q, k, v, first, scale):
    """q [n, H, E] of rows first.. over k [m, H, E], v [m, H, Ev], causal → [n, H·Ev]."""
    allowed = torch.arange(k.shape[0])[None] <= (first + torch.arange(q.shape[0]))[:, None]
    scores = torch.einsum("qhd,khd->hqk", q, k).mul(scale).masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).flatten(1)


def rotate_half_rope(x, pos, theta, inv=None, factor=1.0):  # x [n, heads, dim]
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim) if inv is None else inv
    ang = torch.cat([pos[:, None].double() * inv[None]] * 2, -1)[:, None]  # [n, 1, dim]
    half = torch.cat([-x[..., dim // 2:], x[..., : dim // 2]], -1)
    return x * (ang.cos() * factor).float() + half * (ang.sin() * factor).float()


def yarn_inv_freq(dim=ROPE, base=10000.0, y=YARN):
    freqs = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)

    def turn(rot):
        return dim * math.log(y["original_max_position_embeddings"] / (rot * 2 * math.pi)) / (2 * math.log(base))
    lo, hi = max(math.floor(turn(y["beta_fast"])), 0), min(math.ceil(turn(y["beta_slow"])), dim - 1)
    extrapolate = 1 - ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    return freqs / y["factor"] * (1 - extrapolate) + freqs * extrapolate


def interleaved_rope(x, pos):  # HF remote code: de-interleave pairs, then rotate-half with the YaRN table
    n, h, dim = x.shape
    return rotate_half_rope(x.view(n, h, dim // 2, 2).transpose(-1, -2).reshape(n, h, dim), pos, 0, yarn_inv_freq())


def swiglu(t, prefix, x):
    return (F.silu(x @ t[prefix + "gate_proj.weight"].T) * (x @ t[prefix + "up_proj.weight"].T)) @ \
        t[prefix + "down_proj.weight"].T


def deepseek_moe(t, x):
    m, out = P + "mlp.", []
    for row in x:
        s = torch.sigmoid(row @ t[m + "gate.weight"].T)
        b = s + t[m + "gate.e_score_correction_bias"]
        groups = b.view(3, 2).sum(-1).topk(2).indices.tolist()  # two experts per group: both are its top 2
        chosen = sorted((e for e in range(EXPERTS) if e // 2 in groups), key=lambda e: -float(b[e]))[:2]
        w = s[chosen] / s[chosen].sum() * 2.5
        out.append(sum(w[i] * swiglu(t, m + f"experts.{e}.", row) for i, e in enumerate(chosen)))
    return torch.stack(out) + swiglu(t, m + "shared_experts.", x)


def deepseek_rows(t, hidden, tokens, pos, cache):
    """Rows (hidden [n, d], tokens [n]) at positions pos [n] → outputs [n, d] (pre-norm); cache: k, v lists."""
    w = {k[len(P):]: v for k, v in t.items() if k.startswith(P)}
    e = w["embed_tokens.weight"][tokens] * (pos != 0)[:, None]  # position 0's embedding zeroed (vLLM)
    x = torch.cat([rms(e, w["enorm.weight"]), rms(hidden, w["hnorm.weight"])], -1) @ w["eh_proj.weight"].T
    h = rms(x, w["input_layernorm.weight"])
    q = (rms(h @ w["self_attn.q_a_proj.weight"].T, w["self_attn.q_a_layernorm.weight"]) @
         w["self_attn.q_b_proj.weight"].T).view(-1, HEADS, NOPE + ROPE)
    c, k_pe = (h @ w["self_attn.kv_a_proj_with_mqa.weight"].T).split([KVR, ROPE], -1)
    kv = (rms(c, w["self_attn.kv_a_layernorm.weight"]) @ w["self_attn.kv_b_proj.weight"].T).view(-1, HEADS, NOPE + VD)
    k = torch.cat([kv[..., :NOPE], interleaved_rope(k_pe[:, None], pos).expand(-1, HEADS, -1)], -1)
    q = torch.cat([q[..., :NOPE], interleaved_rope(q[..., NOPE:], pos)], -1)
    cache[0].append(k)
    cache[1].append(kv[..., NOPE:])
    mscale = 0.1 * math.log(YARN["factor"]) + 1
    o = attention(q, torch.cat(cache[0]), torch.cat(cache[1]), int(pos[0]), (NOPE + ROPE) ** -0.5 * mscale ** 2)
    x = x + o @ w["self_attn.o_proj.weight"].T
    return x + deepseek_moe(t, rms(x, w["post_attention_layernorm.weight"]))


def deepseek_logits(t, out):
    return rms(out, t[P + "shared_head.norm.weight"]) @ t[P + "shared_head.head.weight"].T


def qwen_tensors(target, seed=12) -> dict[str, torch.Tensor]:
    g, a, m = torch.Generator().manual_seed(seed), Q + "self_attn.", Q + "mlp."

    def zc(n):  # zero-centred norm weights: y = x̂ · (1 + w)
        return 0.1 * torch.randn(n, generator=g)
    t = {"model.embed_tokens.weight": target.model.embed_tokens.weight.detach().clone(),
         "lm_head.weight": target.lm_head.weight.detach().clone(), "mtp.fc.weight": _w(g, D, 2 * D),
         "mtp.pre_fc_norm_embedding.weight": zc(D), "mtp.pre_fc_norm_hidden.weight": zc(D), "mtp.norm.weight": zc(D),
         Q + "input_layernorm.weight": zc(D), Q + "post_attention_layernorm.weight": zc(D),
         a + "q_proj.weight": _w(g, QH * QDH * 2, D), a + "k_proj.weight": _w(g, QKV * QDH, D),
         a + "v_proj.weight": _w(g, QKV * QDH, D), a + "o_proj.weight": _w(g, D, QH * QDH),
         a + "q_norm.weight": zc(QDH), a + "k_norm.weight": zc(QDH), m + "gate.weight": _w(g, QEXPERTS, D),
         m + "shared_expert_gate.weight": _w(g, 1, D)}
    for e in range(QEXPERTS):
        t |= _expert(g, m + f"experts.{e}.", WIDTH)
    return t | _expert(g, m + "shared_expert.", QSHARED)


def qwen_rows(t, hidden, tokens, pos, cache):
    """Qwen3-Next MTP rows → outputs [n, d] after mtp.norm (what vLLM's module returns)."""
    def zn(x, key):
        return rms(x, 1 + t[key])
    a, m = Q + "self_attn.", Q + "mlp."
    e = t["model.embed_tokens.weight"][tokens]
    x = torch.cat([zn(e, "mtp.pre_fc_norm_embedding.weight"), zn(hidden, "mtp.pre_fc_norm_hidden.weight")], -1)
    x = x @ t["mtp.fc.weight"].T
    h = zn(x, Q + "input_layernorm.weight")
    q, gate = (h @ t[a + "q_proj.weight"].T).view(-1, QH, 2 * QDH).split(QDH, -1)

    def partial(y):  # RoPE on the first QROT dims of each head
        return torch.cat([rotate_half_rope(y[..., :QROT], pos, QWEN["rope_theta"]), y[..., QROT:]], -1)
    q = partial(zn(q, a + "q_norm.weight"))
    cache[0].append(partial(zn((h @ t[a + "k_proj.weight"].T).view(-1, QKV, QDH), a + "k_norm.weight")))
    cache[1].append((h @ t[a + "v_proj.weight"].T).view(-1, QKV, QDH))
    k, v = (torch.cat(c).repeat_interleave(QH // QKV, 1) for c in cache)
    o = attention(q, k, v, int(pos[0]), QDH ** -0.5) * torch.sigmoid(gate.reshape(-1, QH * QDH))
    x = x + o @ t[a + "o_proj.weight"].T
    y, moe = zn(x, Q + "post_attention_layernorm.weight"), []
    for row in y:
        p = torch.softmax(row @ t[m + "gate.weight"].T, -1)
        top = p.topk(2)
        moe.append(sum(wt / top.values.sum() * swiglu(t, m + f"experts.{e}.", row)
                       for wt, e in zip(top.values, top.indices.tolist(), strict=True)))
    shared = torch.sigmoid(y @ t[m + "shared_expert_gate.weight"].T) * swiglu(t, m + "shared_expert.", y)
    return zn(x + torch.stack(moe) + shared, "mtp.norm.weight")


def reference_chain(rows, logits_of, t, taps, ids, steps):
    """Context rows (taps_j, ids[j+1]) at j, then `steps` greedy drafts, each draft row's hidden the previous
    output → tokens, peaks, the first draft's logits."""
    cache = ([], [])
    out = rows(t, taps, torch.tensor(ids[1:]), torch.arange(len(taps)), cache)[-1:]
    tokens, peaks, first = [], [], None
    for s in range(steps):
        logits = logits_of(t, out)[0]
        first = logits if first is None else first
        tokens.append(int(logits.argmax()))
        peaks.append(float(logits.softmax(-1).max()))
        out = rows(t, out, torch.tensor(tokens[-1:]), torch.tensor([len(taps) + s]), cache)
    return tokens, peaks, first


FORMATS = {"deepseek": (DEEPSEEK, deepseek_tensors, deepseek_rows, deepseek_logits),
           "qwen3_next": (QWEN, qwen_tensors, qwen_rows, lambda t, out: out @ t["lm_head.weight"].T)}


def context(seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(11, D, generator=g) * 2, torch.randint(4, 300, (12,), generator=g).tolist()


def draft(model, taps, ids, gamma, temperature=0.0):
    drafter = Drafter(model)
    drafter.commit("r", 0, taps)
    return drafter.propose({"r": ids}, gamma, {"r": SamplingParams(temperature=temperature)})["r"]


def write_format(path, target, name, fp8=False, config=None, edit=None):
    base, tensors_of, _, _ = FORMATS[name]
    tensors = tensors_of(target)
    if edit is not None:
        edit(tensors)
    main = {k: v for k, v in main_stand_ins().items() if k not in tensors}  # Qwen3-Next's embedding / head are real
    return write(path, {**base, **(config or {})}, tensors, fp8, main)


# ---- parity ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "fp8"), [("deepseek", False), ("deepseek", True), ("qwen3_next", False)],
                         ids=["deepseek", "deepseek-fp8", "qwen3_next"])
def test_mtp_drafts_match_the_reference(tmp_path, target, name, fp8):
    used = write_format(tmp_path / "m", target, name, fp8)
    cfg = drafter_config(tmp_path / "m", "auto", LAYERS)
    assert (str(cfg.method), cfg.tap_layers, cfg.block_size) == ("mtp", (LAYERS,), 1)
    model, _ = load_drafter(tmp_path / "m", target, "float32")
    assert torch.equal(model.lm_head.weight, target.lm_head.weight)  # the shipped copies equal the target's
    _, _, rows, logits_of = FORMATS[name]
    taps, ids = context()
    for gamma in (1, 3):  # γ = 1 is MTP's block; γ = 3 feeds each draft row the module's own output (vLLM)
        tokens, peaks, first = reference_chain(rows, logits_of, used, taps, ids, gamma)
        block = draft(model, taps, ids, gamma)
        assert block.tokens == tokens
        torch.testing.assert_close(torch.tensor(block.peaks), torch.tensor(peaks), atol=1e-5, rtol=1e-5)
    sampled = draft(model, taps, ids, 1, temperature=1.0)  # q: the top 64 of softmax(logits), renormalised
    top = first.softmax(-1).topk(64)
    assert sampled.q_ids.view(-1).tolist() == top.indices.tolist()
    torch.testing.assert_close(sampled.q_probs[0], top.values / top.values.sum(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("name", "wrong"), [
    ("deepseek", lambda m: m.eh_proj.weight.data.copy_(m.eh_proj.weight.data.roll(D, 1))),  # [hidden; emb] order
    ("qwen3_next", lambda m: m.norm.weight.data.sub_(1)),  # the final norm loaded without its +1
    ("qwen3_next", lambda m: m.layer.self_attn.q_norm.weight.data.sub_(1)),
], ids=["eh_proj-halves", "qwen-norm-without-1", "qwen-q-norm-without-1"])
def test_the_reference_tells_a_wrong_load_apart(tmp_path, target, name, wrong):
    used = write_format(tmp_path / "m", target, name)
    model, _ = load_drafter(tmp_path / "m", target, "float32")
    wrong(model)
    taps, ids = context()
    _, peaks, _ = reference_chain(*FORMATS[name][2:], used, taps, ids, 1)
    assert not torch.allclose(torch.tensor(draft(model, taps, ids, 1).peaks), torch.tensor(peaks), atol=1e-5)


@pytest.mark.parametrize("name", list(FORMATS))
def test_greedy_with_an_mtp_module_is_plain_greedy(tmp_path, target, name):
    write_format(tmp_path / "m", target, name)
    assert_greedy_is_plain(target, load_drafter(tmp_path / "m", target, "float32")[0], 1)


def test_only_the_module_shards_are_read(tmp_path, target):
    """A sharded Qwen3-Next checkpoint whose main-model shard is absent still loads: only mtp.* and the shared
    embedding / head are opened."""
    path = tmp_path / "q"
    used = write_format(path, target, "qwen3_next")
    (path / "model.safetensors").unlink()
    shared = {k: used[k] for k in ("model.embed_tokens.weight", "lm_head.weight")}
    save_file({k: v for k, v in used.items() if k not in shared}, str(path / "model-00002-of-00003.safetensors"))
    save_file(shared, str(path / "model-00003-of-00003.safetensors"))
    weight_map = dict.fromkeys(main_stand_ins(), "model-00001-of-00003.safetensors")  # never written
    weight_map |= dict.fromkeys(set(used) - set(shared), "model-00002-of-00003.safetensors")
    weight_map |= dict.fromkeys(shared, "model-00003-of-00003.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model, _ = load_drafter(path, target, "float32")
    taps, ids = context()
    assert draft(model, taps, ids, 1).tokens == reference_chain(*FORMATS["qwen3_next"][2:], used, taps, ids, 1)[0]


# ---- refusals --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "config", "edit", "message"), [
    ("deepseek", None, lambda t: t.pop(P + "mlp.experts.4.up_proj.weight"), r"missing \['layer.mlp.experts.4.up"),
    ("deepseek", None, lambda t: t.update({P + "eh_proj.weight": torch.zeros(D, D)}), "wrong shapes: eh_proj.weight"),
    ("deepseek", None, lambda t: t.update({P + "mystery.weight": torch.zeros(2)}),
     "unexpected tensor 'model.layers.8.mystery"),
    ("deepseek", {"n_group": 4}, None, "n_group 4.*inconsistent"),
    ("deepseek", {"num_hidden_layers": 9}, None, "9-layer model, the target has 8"),
    ("deepseek", {"scoring_func": "softmax"}, None, "scoring_func 'softmax'"),
    ("deepseek", {"num_nextn_predict_layers": 2}, None, "num_nextn_predict_layers 2"),
    ("deepseek", {"kv_lora_rank": None}, None, "lacks kv_lora_rank"),
    ("deepseek", {"hidden_size": 48}, None, "width/vocab 48/384"),
    ("qwen3_next", None, lambda t: t.pop("mtp.norm.weight"), r"missing \['norm.weight"),
    ("qwen3_next", None, lambda t: t.update({Q + "self_attn.q_proj.weight": torch.zeros(QH * QDH, D)}),
     "wrong shapes: layer.self_attn.q_proj"),
    ("qwen3_next", {"rope_scaling": {"type": "yarn", "factor": 2.0}}, None, "rope scaling"),
])
def test_inconsistent_checkpoints_fail_at_load_naming_the_field(tmp_path, target, name, config, edit, message):
    write_format(tmp_path / "m", target, name, config=config, edit=edit)
    with pytest.raises(ModelLoadError, match=message):
        load_drafter(tmp_path / "m", target, "float32")


def test_fp8_without_or_with_wrong_scales_is_refused(tmp_path, target):
    write_format(tmp_path / "m", target, "deepseek", fp8=True)
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    name = P + "self_attn.o_proj.weight"
    for broken, message in (({name + "_scale_inv": None}, "o_proj.weight has no weight_scale_inv"),
                            ({name + "_scale_inv": torch.ones(1, 1)}, r"o_proj.weight_scale_inv \[1, 1\]")):
        state = {k: v for k, v in (tensors | broken).items() if v is not None}
        save_file(state, str(tmp_path / "m" / "model.safetensors"))
        with pytest.raises(ModelLoadError, match=message):
            load_drafter(tmp_path / "m", target, "float32")


# ---- detection, forcing, the vLLM / SGLang names ------------------------------------------------------------
def test_detected_from_config_and_forced_by_name(tmp_path, target):
    assert detect(DEEPSEEK, "x") == "deepseek_mtp" and detect(QWEN, "x") == "qwen3_next_mtp"
    assert declared_method(QWEN, "x") == "mtp"
    with pytest.raises(ModelLoadError, match="num_nextn_predict_layers"):  # a plain target is no drafter
        detect({**DEEPSEEK, "num_nextn_predict_layers": 0}, "x")
    write_format(tmp_path / "m", target, "deepseek", config={"model_type": "something_else"})
    model, _ = load_drafter(tmp_path / "m", target, "float32", fmt="deepseek_mtp")
    assert model.config.kind == "deepseek_mtp"


def test_vllm_mtp_without_a_model_is_the_targets_own_module(tmp_path, target):
    write_format(tmp_path / "m", target, "deepseek")
    router, drafter = {}, {"model": str(tmp_path / "m")}
    apply(Speculative("mtp"), router, drafter)
    assert drafter["drafters"] == [str(tmp_path / "m")] and router["policy"] == "mtp1"
    shipped = {"model": "dspark-target"}  # no MTP module inside: the pool keeps the target's shipped drafters
    apply(Speculative("mtp"), {}, shipped)
    assert "drafters" not in shipped


# ---- the final-hidden tap (services/model.py) ---------------------------------------------------------------
def test_tap_L_is_the_final_normed_hidden_in_both_forwards():
    model = tiny_target((1, LAYERS))
    ids = torch.randint(4, 300, (9,), generator=torch.Generator().manual_seed(1))
    dense = model.forward_dense(ids[None])
    torch.testing.assert_close(dense.features[0, :, D:], dense.hidden[0])
    torch.testing.assert_close(dense.logits[0], dense.features[0, :, D:] @ model.lm_head.weight.T)
    cached = full_forward(model, ids)
    torch.testing.assert_close(cached.features, dense.features[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cached.logits, dense.logits[0].float(), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"outside 0\.\.8"):
        tiny_target((LAYERS + 1,))


def test_convert_refuses_an_mtp_module(tmp_path, target):
    write_format(tmp_path / "m", target, "qwen3_next")
    with pytest.raises(ModelLoadError, match="no dspark layout"):
        save_drafter(load_drafter(tmp_path / "m", target, "float32")[0], tmp_path / "out")

"""`dspark convert-drafter SRC OUT --to FORMAT`: a drafter written back in a released format loads through the
ordinary loaders with format detection and drafts exactly the same blocks (greedy and sampled: tokens, q,
peaks, confidences; fp32); its files hold exactly the tensor names, shapes and config fields the format
definition lists (docs/drafters.md, Released checkpoint formats, checked here without the loaders); what a format
cannot express is refused by name and nothing is written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli.main import main
from drafter_worker.checkpoint import build_draft_model, load_drafter, save_drafter
from drafter_worker.config import DrafterConfig
from drafter_worker.drafter import Drafter
from services.loader import load_model
from services.registry import MODELS_DIR, resolve_model
from services.types import SamplingParams
from tests.draft_formats import BLOCK, DRAFT_LAYERS, LAYERS, MASK, RANK, TAPS, TARGET_CONFIG, save_target, tiny_target
from tests.test_drafter_formats import write_deepspec
from tests.test_drafter_formats_dflash import write as write_dflash
from tests.test_drafter_formats_eagle3 import write_eagle3

SHIPPED = "dspark-target"
TAPS5 = (0, 1, 3, 5, 6)


@pytest.fixture(scope="module")
def tiny():
    return tiny_target()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tiny):
    path = tmp_path_factory.mktemp("tiny")
    return save_target(path, tiny)


@pytest.fixture(scope="module")
def shipped():
    return load_model(resolve_model(SHIPPED), "float32", "cpu")


# ---- the formats' definitions, written from the released formats (not from the writers or the loaders) ------
def _layer(prefix, c, d_in, qk_norm):
    d, h, kv, dh, ff = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
    t = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
         "self_attn.q_proj.weight": (h * dh, d_in), "self_attn.k_proj.weight": (kv * dh, d_in),
         "self_attn.v_proj.weight": (kv * dh, d_in),
         "self_attn.o_proj.weight": (d, h * dh), "mlp.gate_proj.weight": (ff, d), "mlp.up_proj.weight": (ff, d),
         "mlp.down_proj.weight": (d, ff)}
    t |= {"self_attn.q_norm.weight": (dh,), "self_attn.k_norm.weight": (dh,)} if qk_norm else {}
    return {prefix + k: v for k, v in t.items()}


def expected_tensors(fmt, model, target):
    """§3.1 (SpecForge EAGLE-3), §2.6 (DeepSpec EAGLE-3), §2.2 (DeepSpec DSpark/DFlash), §4.1–4.2 (z-lab, SpecForge)."""
    c, dc = model.config, model.dconfig
    d, v, taps = c.hidden_size, c.vocab_size, len(dc.tap_layers)
    if fmt == "specforge-eagle3":  # no embedding; own head [Vd, d] with d2t [Vd] and t2d [V]
        vd = dc.draft_vocab_size or v
        return _layer("midlayer.", c, 2 * d, False) | {"midlayer.hidden_norm.weight": (d,), "fc.weight": (d, 3 * d),
                                                       "norm.weight": (d,), "lm_head.weight": (vd, d), "d2t": (vd,),
                                                       "t2d": (v,)}
    vocab = {"embed_tokens.weight": (v, d), "lm_head.weight": (v, d)}  # DeepSpec's frozen copies
    if fmt == "deepspec-eagle3":
        return _layer("layers.0.", c, 2 * d, True) | vocab | {"layers.0.hidden_norm.weight": (d,),
                                                              "fc.weight": (d, 5 * d), "norm.weight": (d,)}
    t = {"fc.weight": (d, taps * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(dc.num_layers):
        t |= _layer(f"layers.{i}.", c, d, True)
    r = dc.markov_rank
    heads = {"markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r)} if r else {}
    if dc.confidence_head:
        heads |= {"confidence_head.proj.weight": (1, d + r), "confidence_head.proj.bias": (1,)}
    return {"deepspec": t | heads | vocab, "zlab-dflash": t, "specforge-dspark": t | heads}[fmt]


def expected_config(fmt, model, target):
    """The config.json fields each format's readers take (§2.3, §2.6, §3.2, §4.1, §4.2)."""
    c, dc, lt = model.config, model.dconfig, target.config.num_hidden_layers
    dims = {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "head_dim": c.head_dim,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "vocab_size": c.vocab_size, "rope_theta": c.rope.theta, "rms_norm_eps": c.rms_norm_eps,
            "tie_word_embeddings": False}
    taps = list(dc.tap_layers)
    if fmt == "specforge-eagle3":
        return dims | {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
                       "draft_vocab_size": dc.draft_vocab_size or c.vocab_size,
                       "eagle_config": {"eagle_aux_hidden_state_layer_ids": taps, "use_aux_hidden_state": True}}
    if fmt == "deepspec-eagle3":
        return dims | {"architectures": ["Qwen3Eagle3Model"], "model_type": "qwen3", "num_hidden_layers": 1,
                       "draft_num_hidden_layers": 1, "num_target_layers": lt, "target_layer_ids": taps,
                       "ttt_length": dc.block_size, "step_loss_decay": 0.8, "layer_types": ["full_attention"]}
    block = dims | {"model_type": "qwen3", "num_hidden_layers": dc.num_layers, "num_target_layers": lt,
                    "layer_types": ["full_attention"] * dc.num_layers}
    markov = dc.markov_rank > 0
    if fmt == "deepspec":
        return block | {"architectures": ["Qwen3DSparkModel"], "block_size": dc.block_size, "target_layer_ids": taps,
                        "mask_token_id": dc.mask_token_id, "markov_rank": dc.markov_rank,
                        "enable_confidence_head": dc.confidence_head,
                        "markov_head_type": "vanilla" if markov else None,
                        "confidence_head_with_markov": True if dc.confidence_head else None}
    fill_in = dc.layout == "fill_in"
    if fmt == "zlab-dflash":
        return block | {"architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
                        "block_size": dc.block_size + 1,
                        "dflash_config": {"mask_token_id": dc.mask_token_id, "target_layer_ids": taps}}
    return block | {"architectures": ["DSparkDraftModel"], "auto_map": {"AutoModel": "dspark.DSparkDraftModel"},
                    "block_size": dc.block_size + fill_in, "sample_from_anchor": not fill_in,
                    "dflash_config": {"mask_token_id": dc.mask_token_id, "target_layer_ids": taps,
                                      "projector_type": "dspark", "markov_rank": dc.markov_rank,
                                      "markov_head_type": "vanilla", "enable_confidence_head": dc.confidence_head,
                                      "confidence_head_alpha": 1.0 if dc.confidence_head else 0.0,
                                      "confidence_head_with_markov": True}}


def check_vocab_map(tensors):
    """§1.4: target id i + d2t[i] strictly increasing inside [0, V); t2d marks exactly those ids."""
    hot = torch.arange(len(tensors["d2t"])) + tensors["d2t"]
    assert bool((hot[1:] > hot[:-1]).all()) and int(hot.min()) >= 0 and int(hot.max()) < len(tensors["t2d"])
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert int(tensors["t2d"].sum()) == len(hot) and bool(tensors["t2d"][hot].all())


def convert(src, out, target, to) -> int:
    return main(["convert-drafter", str(src), str(out), "--target", str(target), "--to", to, "--dtype", "float32"])


def blocks(model, calibration, gamma, seed=5):
    """A greedy and a sampled (T = 1) first block after 11 positions of random features."""
    g = torch.Generator().manual_seed(seed)
    taps = torch.randn(11, model.feature_width, generator=g)
    ids = torch.randint(4, min(300, model.config.vocab_size), (12,), generator=g).tolist()
    out = []
    for temperature in (0.0, 1.0):
        drafter = Drafter(model, calibration, seed=3)
        drafter.commit("r", 0, taps)
        out.append(drafter.propose({"r": ids}, gamma, {"r": SamplingParams(temperature=temperature)})["r"])
    return out


def assert_same_blocks(a, b, gamma):
    """Bit-identical drafts: the same weights through the same modules in fp32."""
    first, second = blocks(*a, gamma), blocks(*b, gamma)
    assert first[0].q_ids is None and first[1].q_ids is not None  # greedy sends no q, sampling does
    for x, y in zip(first, second, strict=True):
        assert x.tokens == y.tokens and x.peaks == y.peaks and x.confidences == y.confidences
        for qa, qb in ((x.q_ids, y.q_ids), (x.q_probs, y.q_probs)):
            assert (qa is None and qb is None) or torch.equal(qa, qb)


def round_trip(src, out, target_model, target_dir, to, gamma):
    """Convert, check the files against the format definition, load back with detection, compare the drafts."""
    original = load_drafter(src, target_model, "float32")
    assert convert(src, out, target_dir, to) == 0
    tensors = load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    model = original[0]
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected_tensors(to, model, target_model)
    for key, value in expected_config(to, model, target_model).items():
        assert config.get(key) == value, key
    if "t2d" in tensors:
        check_vocab_map(tensors)
    back = load_drafter(out, target_model, "float32")  # no format given: detected from config.json
    assert back[0].dconfig.method == model.dconfig.method and back[0].dconfig.tap_layers == model.dconfig.tap_layers
    assert_same_blocks(original, back, gamma)
    return tensors, config, back


def random_drafter(dcfg, target, seed=1):
    """dspark's own drafter with random weights (norms around 1, so a misplaced norm shows)."""
    model = build_draft_model(dcfg, target).eval()
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name not in ("embed_tokens.weight", "lm_head.weight"):
            p.data = 1 + 0.1 * torch.randn(p.shape, generator=g) if p.dim() == 1 else \
                0.3 * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 * 4
    return model


# ---- supported directions ----------------------------------------------------------------------------------
def test_shipped_eagle3_to_specforge_and_back_to_dspark(tmp_path, shipped):
    src = MODELS_DIR / f"{SHIPPED}-eagle3"
    tensors, config, _ = round_trip(src, tmp_path / "sf", shipped, SHIPPED, "specforge-eagle3", 7)
    assert config["draft_vocab_size"] == shipped.config.vocab_size and not tensors["d2t"].any()  # identity map
    assert torch.equal(tensors["lm_head.weight"], shipped.lm_head.weight)  # the format ships its head
    assert convert(tmp_path / "sf", tmp_path / "own", SHIPPED, "dspark") == 0  # and back into dspark's layout
    assert_same_blocks(load_drafter(src, shipped, "float32"), load_drafter(tmp_path / "own", shipped, "float32"), 7)


def test_shipped_eagle3_with_a_reduced_vocabulary_writes_d2t_and_t2d(tmp_path, shipped):
    from training.draft_vocab import frequency_d2t, reduce_vocab

    full, _ = load_drafter(MODELS_DIR / f"{SHIPPED}-eagle3", shipped, "float32")
    d2t = frequency_d2t(torch.rand(shipped.config.vocab_size, generator=torch.Generator().manual_seed(1)), 1000)
    save_drafter(reduce_vocab(full, d2t), tmp_path / "src", torch.float32)
    tensors, config, back = round_trip(tmp_path / "src", tmp_path / "sf", shipped, SHIPPED, "specforge-eagle3", 7)
    assert config["draft_vocab_size"] == 1000 and torch.equal(tensors["d2t"], d2t)
    assert torch.equal(back[0].d2t, d2t)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_a_specforge_head_survives_the_round_trip(tmp_path, tiny, tiny_dir, norm_before_residual):
    written = write_eagle3(tmp_path / "src", norm_before_residual=norm_before_residual)
    tensors, config, _ = round_trip(tmp_path / "src", tmp_path / "sf", tiny, tiny_dir, "specforge-eagle3", 4)
    assert config.get("norm_before_residual", False) is norm_before_residual and config["rope_theta"] == 1e4
    for name in ("d2t", "t2d", "lm_head.weight", "midlayer.mlp.down_proj.weight"):  # the draft's own, as shipped
        assert torch.equal(tensors[name], written[name])


def test_a_qwen3_eagle3_head_with_five_taps_to_deepspec(tmp_path, tiny, tiny_dir):
    save_drafter(random_drafter(DrafterConfig("eagle3", "tiny", TAPS5), tiny), tmp_path / "src", torch.float32)
    tensors, _, back = round_trip(tmp_path / "src", tmp_path / "ds", tiny, tiny_dir, "deepspec-eagle3", 5)
    assert torch.equal(tensors["embed_tokens.weight"], tiny.model.embed_tokens.weight)  # shipped frozen copies
    assert back[0].config.qk_norm


@pytest.mark.parametrize("markov", [True, False], ids=["dspark", "dflash"])
def test_deepspec_block_drafters_round_trip(tmp_path, tiny, tiny_dir, markov):
    """From dspark's own layout (with a calibration for the DSpark one) back to DeepSpec's."""
    write_deepspec(tmp_path / "src", tiny, markov)
    save_drafter(load_drafter(tmp_path / "src", tiny, "float32")[0], tmp_path / "own", torch.float32)
    if markov:  # a γ = 7 calibration: the sidecar comes along, so calibrated confidences are the same
        shutil.copy(MODELS_DIR / f"{SHIPPED}-dspark" / "calibration.json", tmp_path / "own")
    _, _, back = round_trip(tmp_path / "own", tmp_path / "ds", tiny, tiny_dir, "deepspec", BLOCK)
    assert (back[1] is not None) is markov


def test_the_block_comparison_sees_a_misplaced_norm(tmp_path, tiny, tiny_dir):
    """The round trip's comparison can fail: the written drafter with its context norm read as the final norm."""
    write_deepspec(tmp_path / "src", tiny)
    assert convert(tmp_path / "src", tmp_path / "ds", tiny_dir, "deepspec") == 0
    original, (wrong, _) = load_drafter(tmp_path / "src", tiny, "float32"), load_drafter(tmp_path / "ds", tiny)
    wrong.float().context.hidden_norm.weight.data.copy_(wrong.norm.weight.data)
    with pytest.raises(AssertionError):
        assert_same_blocks(original, (wrong, None), BLOCK)


def test_an_anchor_dspark_to_specforge_dspark(tmp_path, tiny, tiny_dir):
    write_deepspec(tmp_path / "src", tiny)
    _, config, back = round_trip(tmp_path / "src", tmp_path / "sf", tiny, tiny_dir, "specforge-dspark", BLOCK)
    assert config["sample_from_anchor"] is True and back[0].dconfig.layout == "anchor"


def test_fill_in_drafters_go_back_to_zlab_and_specforge(tmp_path, tiny, tiny_dir):
    write_dflash(tmp_path / "z", tiny)
    _, config, _ = round_trip(tmp_path / "z", tmp_path / "z2", tiny, tiny_dir, "zlab-dflash", BLOCK)
    assert config["block_size"] == BLOCK + 1
    write_dflash(tmp_path / "s", tiny, "DSparkDraftModel", sample_from_anchor=False)
    _, config, back = round_trip(tmp_path / "s", tmp_path / "s2", tiny, tiny_dir, "specforge-dspark", BLOCK)
    assert config["sample_from_anchor"] is False and back[0].dconfig.layout == "fill_in"


# ---- refusals: named, and nothing written ------------------------------------------------------------------
@pytest.mark.parametrize(("drafter", "to", "message"), [
    ("dspark", "deepspec", "q_norm / k_norm"), ("dspark", "specforge-dspark", "q_norm / k_norm"),
    ("dflash", "zlab-dflash", "layout anchor"), ("dflash", "specforge-dspark", "carries a Markov head"),
    ("dspark", "zlab-dflash", "no Markov or confidence head"), ("eagle3", "deepspec-eagle3", "q_norm / k_norm"),
    ("dspark", "specforge-eagle3", "holds EAGLE-3 heads"), ("eagle3", "deepspec", "holds block drafters"),
    ("mtp", "specforge-eagle3", "mtp drafter has no released format"), ("mtp", "deepspec", "final normed hidden"),
])
def test_shipped_drafters_a_format_cannot_express_are_refused(tmp_path, capsys, drafter, to, message):
    assert convert(MODELS_DIR / f"{SHIPPED}-{drafter}", tmp_path / "out", SHIPPED, to) == 2
    assert message in " ".join(capsys.readouterr().err.split()) and not (tmp_path / "out").exists()


def _gated(path, tiny):
    save_drafter(random_drafter(DrafterConfig("dspark", "t", TAPS, num_layers=DRAFT_LAYERS, mask_token_id=MASK,
                                              head="gated", markov_rank=RANK, confidence_head=True), tiny), path)


def _own_head(path, tiny):
    tensors = write_deepspec(path, tiny)
    save_file(tensors | {"lm_head.weight": tensors["lm_head.weight"] + 0.5}, str(path / "model.safetensors"))


@pytest.mark.parametrize(("write", "to", "message"), [
    (lambda p, t: write_eagle3(p), "deepspec-eagle3", "q_norm / k_norm"),
    (lambda p, t: save_drafter(random_drafter(DrafterConfig("eagle3", "t", TAPS), t), p), "specforge-eagle3",
     "never normalise q and k"),
    (lambda p, t: save_drafter(random_drafter(DrafterConfig("eagle3", "t", TAPS5, draft_vocab_size=None,
                                                            norm_before_residual=True), t), p),
     "deepspec-eagle3", "norm_before_residual"),
    (lambda p, t: write_eagle3(p, eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}),
     "specforge-eagle3", "PR #25454"),
    (lambda p, t: write_dflash(p, t), "deepspec", "layout fill_in"),
    (lambda p, t: write_dflash(p, t), "specforge-dspark", "carries a Markov head"),
    (lambda p, t: write_deepspec(p, t, target_layer_ids=[1, 3, LAYERS - 1]), "deepspec", f"taps [{LAYERS - 1}]"),
    (_gated, "deepspec", "markov_head_type 'gated'"),
    (_own_head, "specforge-dspark", "lm_head.weight differs from the target's"),
])
def test_what_a_format_cannot_express_is_refused_by_name(tmp_path, capsys, tiny, tiny_dir, write, to, message):
    write(tmp_path / "src", tiny)
    assert convert(tmp_path / "src", tmp_path / "out", tiny_dir, to) == 2
    assert message in " ".join(capsys.readouterr().err.split()) and not (tmp_path / "out").exists()


def test_a_reduced_vocabulary_has_no_deepspec_eagle3_form(tmp_path, capsys, tiny, tiny_dir):
    from training.draft_vocab import frequency_d2t, reduce_vocab

    full = random_drafter(DrafterConfig("eagle3", "t", TAPS5), tiny)
    save_drafter(reduce_vocab(full, frequency_d2t(torch.rand(TARGET_CONFIG["vocab_size"]), 100)), tmp_path / "src")
    assert convert(tmp_path / "src", tmp_path / "out", tiny_dir, "deepspec-eagle3") == 2
    assert "d2t" in capsys.readouterr().err and not (tmp_path / "out").exists()

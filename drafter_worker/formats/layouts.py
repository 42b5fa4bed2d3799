"""What each released format holds, as the writers need it: its config.json and its tensor names and shapes
(docs/drafters.md, Released checkpoint formats §2.2–2.3, §2.6, §3.1–3.2, §4.1–4.2), for a given dspark drafter.

`spec_for` refuses, by name and with the reason, what a format's config cannot state (a layout, a head type, a
tap count or convention, a reduced vocabulary, a residual placement); `writers.format_tensors` then refuses any
tensor outside the key set built here (a bias, a q/k norm a Llama layer lacks, one a Qwen3 layer needs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from drafter_worker.config import HeadType, Method
from services.errors import ModelLoadError
from services.model_config import hf_config_dict

# dspark's decoder layers the formats' decoders can stand for (the rest would differ in norms or activation)
_DECODERS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_STEP_LOSS_DECAY = 0.8  # DeepSpec's EAGLE-3 training field; dspark's recipe weighs step k by 0.8^k too


@dataclass
class Spec:
    name: str  # the --to name
    architecture: str
    config: dict
    keys: dict[str, tuple[int, ...]]  # the format's tensor names and shapes
    shipped: frozenset[str]  # which of embed_tokens / lm_head the format stores (the others are the target's)
    chain: bool
    layer_prefix: str = ""
    extra_tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class ConversionRefused(ModelLoadError):
    """The drafter has something (a tensor, a norm placement, a tap convention) the target format cannot say."""


def spec_for(fmt: str, model, target) -> Spec:
    """The format's Spec for this drafter, or a refusal listing everything the format cannot express."""
    dc, cfg = model.dconfig, model.config
    if fmt.endswith("eagle3") != (dc.method is Method.EAGLE3):
        raise ConversionRefused(f"{fmt} holds {'EAGLE-3 heads' if fmt.endswith('eagle3') else 'block drafters'}; "
                                f"this is a {dc.method} drafter")
    if cfg.architecture not in _DECODERS:
        raise ConversionRefused(f"{fmt}: the drafter's {cfg.architecture} layers are not a Llama / Qwen3 layer")
    no: list[str] = []
    qwen3_layers = fmt != "specforge-eagle3"
    if cfg.qk_norm != qwen3_layers:
        no.append(f"self_attn.q_norm / k_norm: the format's layers {'always' if qwen3_layers else 'never'} "
                  f"normalise q and k per head (a {'Qwen3' if qwen3_layers else 'Llama'} layer), the drafter's "
                  f"{cfg.architecture} layers {'do not' if qwen3_layers else 'do'}; RMSNorm with weight 1 is not the "
                  "identity, so neither stands in for the other")
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":  # every format's MLP is SwiGLU
        no.append(f"mlp: hidden_act {act!r}: the format's MLP is SiLU-gated (SwiGLU)")
    no += tap_refusals(dc.tap_layers, target.config.num_hidden_layers)
    build = {"specforge-eagle3": _specforge_eagle3, "deepspec-eagle3": _deepspec_eagle3, "deepspec": _deepspec,
             "zlab-dflash": _zlab, "specforge-dspark": _specforge_dspark}[fmt]
    spec = build(model, target.config.num_hidden_layers, no)
    if no:
        raise ConversionRefused(f"{fmt} cannot express this {dc.method} drafter: " + "; ".join(no))
    return spec


def tap_refusals(taps: tuple[int, ...], layers: int) -> list[str]:
    """Every format indexes taps as HF `hidden_states[id + 1]`, whose last entry is after the final norm: no format
    names dspark's tap L − 1 (pre-norm; DeepSpec's assert_no_final_target_layer refuses it) or L (an MTP's)."""
    no = []
    bad = [t for t in taps if not 0 <= t <= layers - 2]
    if bad:
        no.append(f"taps {bad}: a layer id k reads HF hidden_states[k + 1], whose last entry (k = {layers - 1}) is "
                  f"after the final norm; taps 0..{layers - 2} only")
    if list(taps) != sorted(set(taps)):
        no.append(f"taps {list(taps)} are not strictly increasing (target_layer_ids must be)")
    return no


def _base(cfg, layers: int, model_type: str, arch: str) -> dict:
    """The draft's own HF config (transformers-4 rope fields, which every producer writes) for `layers` layers."""
    raw = hf_config_dict(cfg, torch.float32)
    rope = raw.pop("rope_parameters")
    raw.pop("torch_dtype")
    scaling = None if rope["rope_type"] == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
    return {**raw, "architectures": [arch], "model_type": model_type, "num_hidden_layers": layers,
            "rope_scaling": scaling, "tie_word_embeddings": False}


def _layer(cfg, prefix: str, in_dim: int, qk_norm: bool, eagle: bool) -> dict[str, tuple[int, ...]]:
    d, h, kv, dh, ff = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                        cfg.intermediate_size)
    keys = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
            "self_attn.q_proj.weight": (h * dh, in_dim), "self_attn.k_proj.weight": (kv * dh, in_dim),
            "self_attn.v_proj.weight": (kv * dh, in_dim), "self_attn.o_proj.weight": (d, h * dh),
            "mlp.gate_proj.weight": (ff, d), "mlp.up_proj.weight": (ff, d), "mlp.down_proj.weight": (d, ff)}
    if qk_norm:
        keys |= {"self_attn.q_norm.weight": (dh,), "self_attn.k_norm.weight": (dh,)}
    if eagle:
        keys["hidden_norm.weight"] = (d,)
    return {prefix + k: v for k, v in keys.items()}


def _vocab(cfg) -> dict[str, tuple[int, ...]]:
    shape = (cfg.vocab_size, cfg.hidden_size)
    return {"embed_tokens.weight": shape, "lm_head.weight": shape}


# ---- EAGLE-3 -----------------------------------------------------------------------------------------------
def _specforge_eagle3(model, layers: int, no: list[str]) -> Spec:
    dc, cfg, d = model.dconfig, model.config, model.config.hidden_size
    taps = list(dc.tap_layers)
    if len(taps) != 3:
        no.append(f"fc.weight [d, 3·d] reads exactly three taps; this drafter reads {len(taps)}")
    if taps[0] != 1:  # SGLang ≥ PR #25454 adds 1 only when the first id is 1; older versions always do
        no.append(f"eagle_config.eagle_aux_hidden_state_layer_ids {taps}: ids not starting at 1 "
               "are read as input-to-layer ids by SGLang since PR #25454 and as output-of-layer ids before it")
    vd = dc.draft_vocab_size or cfg.vocab_size
    d2t = model.d2t.detach().cpu().long() if model.reduced_vocab else torch.zeros(vd, dtype=torch.long)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[torch.arange(vd) + d2t] = True
    config = _base(cfg, 1, "llama", "LlamaForCausalLMEagle3") | {
        "draft_vocab_size": vd,
        # nested: SpecForge / SGLang's output-of-layer ids (the loaders' reading); top level: vLLM's input-to-layer
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": taps, "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": [t + 1 for t in taps]}
    if dc.norm_before_residual:  # vLLM's field (SGLang and SpecForge put the residual on the raw hidden)
        config["norm_before_residual"] = True
    keys = _layer(cfg, "midlayer.", 2 * d, qk_norm=False, eagle=True) | {
        "fc.weight": (d, 3 * d), "norm.weight": (d,), "lm_head.weight": (vd, d), "d2t": (vd,),
        "t2d": (cfg.vocab_size,)}
    return Spec("specforge-eagle3", "LlamaForCausalLMEagle3", config, keys, frozenset({"lm_head.weight"}), True,
                "midlayer.", {"d2t": d2t, "t2d": t2d})


def _deepspec_eagle3(model, layers: int, no: list[str]) -> Spec:
    dc, cfg, d = model.dconfig, model.config, model.config.hidden_size
    if len(dc.tap_layers) != 5:
        no.append(f"target_layer_ids must be exactly five (DeepSpec's validate_eagle3_target_layer_ids"
               f"); this drafter reads {len(dc.tap_layers)} taps")
    if model.reduced_vocab:
        no.append("d2t: Qwen3Eagle3Model drafts over the full vocabulary (lm_head [V, d])")
    if dc.norm_before_residual:
        no.append("norm_before_residual: Qwen3Eagle3Model's residual is the raw hidden")
    config = _base(cfg, 1, "qwen3", "Qwen3Eagle3Model") | {
        "draft_num_hidden_layers": 1, "num_target_layers": layers, "target_layer_ids": list(dc.tap_layers),
        "ttt_length": dc.block_size, "step_loss_decay": _STEP_LOSS_DECAY, "layer_types": ["full_attention"],
        "target_model_name_or_path": dc.target}
    keys = _layer(cfg, "layers.0.", 2 * d, qk_norm=True, eagle=True) | _vocab(cfg) | {
        "fc.weight": (d, 5 * d), "norm.weight": (d,)}
    return Spec("deepspec-eagle3", "Qwen3Eagle3Model", config, keys, frozenset(_vocab(cfg)), True, "layers.0.")


# ---- block drafters ----------------------------------------------------------------------------------------
def _backbone(model, layers: int, arch: str) -> tuple[dict, dict]:
    dc, cfg, d = model.dconfig, model.config, model.config.hidden_size
    config = _base(cfg, dc.num_layers, "qwen3", arch) | {
        "num_target_layers": layers, "layer_types": ["full_attention"] * dc.num_layers}
    keys = {"fc.weight": (d, len(dc.tap_layers) * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(dc.num_layers):
        keys |= _layer(cfg, f"layers.{i}.", d, qk_norm=True, eagle=False)
    return config, keys


def _heads(model, no: list[str]) -> dict[str, tuple[int, ...]]:
    dc, cfg = model.dconfig, model.config
    if dc.head is None:
        return {}
    if dc.head is not HeadType.MARKOV:
        no.append(f"markov_head_type {dc.head.value!r}: only the vanilla Markov head is written (the input order of "
               "DeepSpec's gated / rnn projections is not verified here)")
    keys = {"markov_head.markov_w1.weight": (cfg.vocab_size, dc.markov_rank),
            "markov_head.markov_w2.weight": (cfg.vocab_size, dc.markov_rank)}
    if dc.confidence_head:
        keys |= {"confidence_head.proj.weight": (1, cfg.hidden_size + dc.markov_rank),
                 "confidence_head.proj.bias": (1,)}
    return keys


def _fill_in_refusal(arch: str) -> str:
    return (f"layout fill_in: {arch}'s block is the anchor layout (slot k predicts position p + k + 1); a "
            "fill-in drafter's slot k predicts p + k, and no relabelling of its tensors gives the same drafts")


def _deepspec(model, layers: int, no: list[str]) -> Spec:
    dc = model.dconfig
    if dc.layout != "anchor":
        no.append(_fill_in_refusal("Qwen3DSparkModel"))
    config, keys = _backbone(model, layers, "Qwen3DSparkModel")
    keys |= _heads(model, no) | _vocab(model.config)
    config |= {"block_size": dc.block_size, "mask_token_id": dc.mask_token_id, "target_layer_ids": list(dc.tap_layers),
               "enable_confidence_head": dc.confidence_head, "markov_rank": dc.markov_rank}
    if dc.confidence_head:
        config["confidence_head_with_markov"] = True
    if dc.head is not None:
        config["markov_head_type"] = "vanilla"
    return Spec("deepspec", "Qwen3DSparkModel", config, keys, frozenset(_vocab(model.config)), False)


def _zlab(model, layers: int, no: list[str]) -> Spec:
    dc = model.dconfig
    if dc.method is not Method.DFLASH:
        no.append("DFlashDraftModel has no Markov or confidence head (markov_head.*, confidence_head.*); "
               "write a DSpark drafter as deepspec or specforge-dspark")
    if dc.layout != "fill_in":
        no.append("layout anchor: DFlashDraftModel's block is the fill-in layout (B slots, the anchor's "
               "predicts nothing, slot k predicts position p + k); an anchor-layout drafter's slot k predicts "
               "p + k + 1, which the format cannot state: write it as deepspec (markov_rank 0)")
    config, keys = _backbone(model, layers, "DFlashDraftModel")
    config |= {"auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": dc.block_size + 1,
               "dflash_config": {"mask_token_id": dc.mask_token_id, "target_layer_ids": list(dc.tap_layers)}}
    return Spec("zlab-dflash", "DFlashDraftModel", config, keys, frozenset(), False)


def _specforge_dspark(model, layers: int, no: list[str]) -> Spec:
    dc = model.dconfig
    if dc.method is not Method.DSPARK:
        no.append("DSparkDraftModel carries a Markov head (markov_head.*) and this dflash drafter has "
               "none: write it as deepspec (markov_rank 0) or, in the fill-in layout, zlab-dflash")
    config, keys = _backbone(model, layers, "DSparkDraftModel")
    keys |= _heads(model, no)
    anchored = dc.layout == "anchor"
    config |= {"auto_map": {"AutoModel": "dspark.DSparkDraftModel"}, "block_size": dc.block_size + (not anchored),
               "sample_from_anchor": anchored,  # top level, where vLLM's DSpark speculator reads it (default true)
               "dflash_config": {"mask_token_id": dc.mask_token_id, "target_layer_ids": list(dc.tap_layers),
                                 "projector_type": "dspark", "markov_rank": dc.markov_rank,
                                 "markov_head_type": "vanilla", "confidence_head_alpha": 1.0 if dc.confidence_head
                                 else 0.0, "enable_confidence_head": dc.confidence_head,
                                 "confidence_head_with_markov": True}}
    return Spec("specforge-dspark", "DSparkDraftModel", config, keys, frozenset(), False)


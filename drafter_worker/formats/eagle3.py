"""EAGLE-3 heads as vLLM and SGLang serve them: SpecForge / SafeAILab `LlamaForCausalLMEagle3`.

The format (docs/drafters.md, Released checkpoint formats §3): a Llama-style config of the draft's own (its own
head_dim, MLP width, RoPE; no q/k norms even for Qwen3 targets), `draft_vocab_size`, optional
`eagle_config.eagle_aux_hidden_state_layer_ids` (SpecForge/SGLang) or a top-level
`eagle_aux_hidden_state_layer_ids` (vLLM), `norm_before_residual` (vLLM speculators). Tensors: `fc`
[d, 3d], `midlayer.*` (or vLLM's `layers.0.*`): `input_layernorm` (on the embedding), `hidden_norm` (on the
hidden), attention over the 2d-wide concatenation, MLP; `norm`; the draft's own `lm_head` [Vd, d]; `d2t`
[Vd] (draft id i ↔ target id i + d2t[i]) and `t2d` [V] (membership, training only). No embedding: the
target's.

Tap ids: SGLang adds 1 to SpecForge's ids, so they mean "output of decoder layer k" (dspark's meaning,
taken as is); vLLM's top-level ids mean "input to layer k" (tap = k − 1); none given: the engines' default
(2, L/2, L−3) as inputs, i.e. taps (1, L/2 − 1, L − 4). The config cannot tell a vLLM-trained head from a
SGLang-trained one for sure, so `convention` overrides (auto | output | input).

DeepSpec's own EAGLE-3 (`deepseek-ai/eagle3_qwen3_*_ttt7`, `Qwen3Eagle3Model`, §2.6) is the same layer with
`layers.0.*` names, q/k norms (its config is the target's Qwen3 config), five `target_layer_ids` in
DeepSpec's output-of-layer meaning, the full vocabulary, and frozen copies of the embedding and LM head.
"""

from __future__ import annotations

import torch

from drafter_worker.config import DrafterConfig, Method
from services.errors import ModelLoadError

SPECFORGE = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
DEEPSPEC = ("Qwen3Eagle3Model",)
ARCHITECTURES = SPECFORGE + DEEPSPEC
CONVENTIONS = ("auto", "output", "input")
_LAYER = {"input_layernorm": "embed_norm", "hidden_norm": "hidden_norm",
          "post_attention_layernorm": "post_attention_layernorm"}


def matches(raw: dict) -> bool:
    return (raw.get("architectures") or [None])[0] in ARCHITECTURES


def is_deepspec(raw: dict) -> bool:
    return (raw.get("architectures") or [None])[0] in DEEPSPEC


def tap_layers(raw: dict, target_layers: int, convention: str, where: str) -> tuple[int, ...]:
    if convention not in CONVENTIONS:
        raise ModelLoadError(f"unknown layer-id convention {convention!r} (known: {', '.join(CONVENTIONS)})")
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    if is_deepspec(raw):
        if "target_layer_ids" not in raw:
            raise ModelLoadError(f"{where}: DeepSpec config.json lacks target_layer_ids")
        ids, meaning = raw["target_layer_ids"], "output"
    elif nested is None and top is None:
        ids, meaning = [2, target_layers // 2, target_layers - 3], "input"
    else:
        ids, meaning = (nested, "output") if nested is not None else (top, "input")
    if convention != "auto":
        meaning = convention
    taps = tuple(int(i) - (meaning == "input") for i in ids)
    if any(not 0 <= t < target_layers for t in taps):
        raise ModelLoadError(f"{where}: layer ids {list(ids)} as {meaning}-of-layer ids give taps {list(taps)}, "
                             f"outside the target's 0..{target_layers - 1}")
    return taps


def drafter_config(raw: dict, where: str, target_layers: int, convention: str = "auto") -> DrafterConfig:
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise ModelLoadError(f"{where}: EAGLE-3 heads of {raw['num_hidden_layers']} layers are not supported (1)")
    if raw.get("target_hidden_size", raw.get("hidden_size")) != raw.get("hidden_size"):
        raise ModelLoadError(f"{where}: target_hidden_size ≠ hidden_size is not supported")
    for key in ("fc_norm", "norm_before_fc"):
        if raw.get(key):
            raise ModelLoadError(f"{where}: {key} is not supported")
    if not (raw.get("eagle_config") or {}).get("use_aux_hidden_state", True):
        raise ModelLoadError(f"{where}: use_aux_hidden_state false (no fc) is not supported")
    vocab, draft_vocab = int(raw["vocab_size"]), raw.get("draft_vocab_size")
    reduced = None if draft_vocab in (None, vocab) else int(draft_vocab)
    return DrafterConfig(Method.EAGLE3, raw.get("target_model_name_or_path", ""),
                         tap_layers(raw, target_layers, convention, where), num_layers=1, block_size=7,
                         draft_vocab_size=reduced, norm_before_residual=bool(raw.get("norm_before_residual", False)))


def rename(state: dict, where: str, vocab_size: int) -> dict:
    """SpecForge/vLLM names → dspark's; `t2d` checked against `d2t` and dropped. Every name is mapped or refused."""
    out = {}
    for name, tensor in state.items():
        prefix = next((p for p in ("midlayer.", "layers.0.") if name.startswith(p)), None)
        if prefix is not None:
            rest = name[len(prefix):]
            module = rest.split(".", 1)[0]
            out["layer." + (_LAYER[module] + rest[len(module):] if module in _LAYER else rest)] = tensor
        elif name == "fc.weight":
            out["context.fc.weight"] = tensor
        elif name in ("norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t"):
            out[name] = tensor
        elif name != "t2d":
            raise ModelLoadError(f"{where}: unexpected tensor {name!r} for an EAGLE-3 checkpoint")
    if "d2t" in out:
        check_vocab_map(out["d2t"], state.get("t2d"), vocab_size, where)
        if len(out["d2t"]) == vocab_size:  # SpecForge exports d2t even for the full vocabulary: the identity
            del out["d2t"]
    return out


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int, where: str) -> None:
    """d2t [Vd]: target ids i + d2t[i] strictly increasing inside [0, V); t2d [V], if given, marks exactly them."""
    if d2t.dim() != 1:
        raise ModelLoadError(f"{where}: d2t must be one-dimensional, got {list(d2t.shape)}")
    hot = torch.arange(len(d2t)) + d2t.long()
    if len(hot) and (hot.min() < 0 or hot.max() >= vocab_size):
        raise ModelLoadError(f"{where}: d2t maps draft ids outside the target vocabulary [0, {vocab_size})")
    if bool((hot[1:] <= hot[:-1]).any()):
        raise ModelLoadError(f"{where}: d2t must map draft ids to strictly increasing target ids")
    marks = t2d is None or (t2d.shape == (vocab_size,) and int(t2d.sum()) == len(d2t) and bool(t2d.bool()[hot].all()))
    if not marks:
        raise ModelLoadError(f"{where}: t2d does not mark exactly the target ids d2t maps to")

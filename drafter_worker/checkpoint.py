"""Drafter checkpoints: build, save and load draft models next to their target.

Layout: `config.json` (the target's config with the drafter's layer count and a `dspark_drafter`
section), `model.safetensors` (the drafter's own weights; embedding and LM head come from the target),
and `calibration.json` when confidences were calibrated. Released formats of other projects load through
`drafter_worker/formats/` (detected from config.json, or forced with `fmt`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Union

import torch
from safetensors.torch import save_file

from drafter_worker.block_model import BlockDraftModel
from drafter_worker.calibration import Calibration
from drafter_worker.chain_model import ChainDraftModel
from drafter_worker.config import DrafterConfig
from drafter_worker.formats import MTP_FORMATS, detect, read_config, read_tensors, reader
from services.embeddings import TargetEmbeddings
from services.errors import ModelLoadError
from services.loader import resolve_device, resolve_dtype
from services.model_config import ModelConfig, hf_config_dict
from services.registry import resolve_model

if TYPE_CHECKING:  # a released MTP module's model, imported only when one is loaded (formats.reader)
    from drafter_worker.formats.mtp_model import MtpDraftModel

DraftModel = Union[BlockDraftModel, ChainDraftModel, "MtpDraftModel"]
def build_draft_model(dcfg: DrafterConfig, target, cfg: ModelConfig | None = None,
                      d2t: torch.Tensor | None = None) -> DraftModel:
    """A fresh draft model on the target's embedding (shared, frozen) and a frozen copy of its LM head — over a
    draft vocabulary, the rows `d2t` names (given: a model to train; absent: the checkpoint's d2t and head come
    at load time); its layers shaped by `cfg` (the draft's own config; default the target's). `target`: a
    loaded target or its `TargetEmbeddings`."""
    target = TargetEmbeddings.of(target)
    cls = BlockDraftModel if dcfg.method.is_block else ChainDraftModel
    model = cls(dcfg, cfg or fresh_layers_config(target.config), target.embed_tokens)
    model = model.to(device=target.device, dtype=target.dtype)
    if model.reduced_vocab and d2t is None:
        return model
    model.index_vocab(d2t)
    model.share_head(target.lm_head.detach().clone())
    return model


def fresh_layers_config(target: ModelConfig) -> ModelConfig:
    """The decoder a fresh drafter's layers are: the target's own; for Gemma (GeGLU, q/k norms, four norms a layer,
    (1 + w) weights — none of it on the drafter kernels, `fused_block` / `fused_chain`) a Llama layer of the
    target's width: heads of 64, two KV heads, SwiGLU, RMSNorm. Saved as the drafter's own config.json."""
    if target.gemma is None:
        return target
    heads = target.hidden_size // 64
    return dataclasses.replace(target, architecture="LlamaForCausalLM", num_attention_heads=heads,
                               num_key_value_heads=2 if heads % 2 == 0 else 1, head_dim=64, qk_norm=False,
                               hidden_act="silu", gemma=None, sliding_window=None, tie_word_embeddings=False)


def shared_names(model: DraftModel) -> tuple[str, ...]:
    """The tensors a drafter takes from its target instead of its checkpoint: the embedding, and the LM head
    unless it is the drafter's own (a released EAGLE-3 head over a draft vocabulary)."""
    own_head = model.reduced_vocab and not model.shares_head
    return ("embed_tokens.weight",) if own_head else ("embed_tokens.weight", "lm_head.weight")


def save_drafter(model: DraftModel, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                 calibration: Calibration | None = None) -> Path:
    if not isinstance(model, BlockDraftModel | ChainDraftModel):  # a released MTP module's MLA / MoE layers
        raise ModelLoadError("a released MTP module is served from its own checkpoint; it has no dspark layout")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(v.dtype if k == "d2t" else dtype).contiguous() for k, v in model.state_dict().items()
             if k not in shared_names(model)}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config_dict(model.config, dtype)
    config["num_hidden_layers"] = model.dconfig.num_layers
    config["dspark_drafter"] = model.dconfig.to_dict()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if calibration is not None:
        calibration.save(out / "calibration.json")
    return out


def drafter_config(model_dir: str | Path, fmt: str = "auto", target_layers: int | None = None,
                   convention: str = "auto") -> DrafterConfig:
    """The checkpoint's DrafterConfig. `target_layers`: the target's decoder layers (an EAGLE-3 head without
    layer ids taps the engines' default ones); `convention`: how to read an EAGLE-3 head's layer ids."""
    raw, where = read_config(Path(model_dir)), str(model_dir)
    fmt = detect(raw, where, fmt)
    if fmt == "deepspec":
        return reader(fmt).drafter_config(raw, where)
    if fmt in MTP_FORMATS:
        return reader(fmt).drafter_config(raw, where, target_layers)
    if fmt in ("eagle3", "dflash") and target_layers is None:
        raise ModelLoadError(f"{where}: reading this drafter's default taps needs the target's layer count")
    if fmt == "eagle3":
        return reader(fmt).drafter_config(raw, where, target_layers, convention)
    if fmt == "dflash":
        return reader(fmt).drafter_config(raw, where, target_layers)
    if "dspark_drafter" not in raw:
        raise ModelLoadError(f"{model_dir}: not a drafter checkpoint (no dspark_drafter in config.json)")
    try:
        return DrafterConfig.from_dict(raw["dspark_drafter"])
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{model_dir}: bad dspark_drafter config: {exc}") from exc


def load_drafter(name_or_dir: str | Path, target, dtype: str | torch.dtype = "auto",
                 device: str | torch.device | None = "cpu", fmt: str = "auto", convention: str = "auto"
                 ) -> tuple[DraftModel, Calibration | None]:
    """Load a drafter next to `target` (a loaded target or its `TargetEmbeddings`: the embedding and LM head
    the drafter shares)."""
    target = TargetEmbeddings.of(target)
    model_dir = resolve_model(name_or_dir)
    raw = read_config(model_dir)
    fmt = detect(raw, str(model_dir), fmt)
    dcfg = drafter_config(model_dir, fmt, target.config.num_hidden_layers, convention)
    if fmt in MTP_FORMATS:  # a module inside the target family's checkpoint, with that family's layers
        model, state = reader(fmt).build(raw, model_dir, fmt, dcfg, target)
        state = own_vocab_weights(state, target)
    else:
        model, state = _chain_or_block(raw, model_dir, fmt, dcfg, target)
    device = resolve_device(device)
    model = model.to(device=device, dtype=resolve_dtype(dtype, device))
    shared = {"embed_tokens.weight"}
    if not model.reduced_vocab or "lm_head.weight" not in state:  # else its own head, stored with it
        shared.add("lm_head.weight")
    expected = set(model.state_dict()) - shared | (set(state) & shared)
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ModelLoadError(f"{model_dir}: tensors missing {missing[:3]}, unexpected {extra[:3]}")
    shapes = model.state_dict()
    wrong = [f"{k} {list(v.shape)} (expected {list(shapes[k].shape)})" for k, v in state.items()
             if v.shape != shapes[k].shape]
    if wrong:
        raise ModelLoadError(f"{model_dir}: wrong shapes: {', '.join(wrong[:3])}")
    model.load_state_dict(state, strict=False)
    if model.reduced_vocab:
        model.index_vocab()  # t2d from the loaded d2t
        if "lm_head.weight" not in state:
            model.share_head(target.lm_head)
    calibration_path = model_dir / "calibration.json"
    calibration = Calibration.load(calibration_path) if calibration_path.is_file() else None
    return model.eval(), calibration


def _chain_or_block(raw: dict, model_dir: Path, fmt: str, dcfg: DrafterConfig, target: TargetEmbeddings):
    """dspark's own draft model for `dcfg`, shaped by the draft's config, and its tensors under dspark's names."""
    cfg = draft_model_config(raw, model_dir, fmt)
    if fmt != "dspark":  # the draft's RoPE table as long as the target's (vLLM raises it too)
        cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings,
                                                                   target.config.max_position_embeddings))
    if (cfg.hidden_size, cfg.vocab_size) != (target.config.hidden_size, target.config.vocab_size):
        raise ModelLoadError(f"{model_dir}: drafter width/vocab {cfg.hidden_size}/{cfg.vocab_size} do not match "
                             f"the target's {target.config.hidden_size}/{target.config.vocab_size}")
    model = build_draft_model(dcfg, target, cfg)
    state = read_tensors(model_dir)
    if fmt == "deepspec":
        state = own_vocab_weights(reader(fmt).rename(state, str(model_dir)), target)
    elif fmt == "eagle3":
        state = own_vocab_weights(reader(fmt).rename(state, str(model_dir), target.config.vocab_size), target)
    elif fmt == "dflash":
        state = reader(fmt).rename(state, str(model_dir))
    return model, state


def draft_model_config(raw: dict, model_dir: Path, fmt: str) -> ModelConfig:
    """The draft's own layer shapes (head_dim, q/k norms, MLP width, RoPE) from its config.json; a foreign
    format's architecture name stands for its model_type's decoder (DeepSpec's Qwen3DSparkModel: Qwen3; an
    EAGLE-3 head is a Llama layer whatever its target)."""
    if fmt == "dspark":
        return ModelConfig.from_dir(model_dir)
    if fmt == "eagle3" and not reader(fmt).is_deepspec(raw):
        return ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"]})
    return ModelConfig.from_dict({**raw, "architectures": []})  # the decoder of its model_type (services/model_config)


def own_vocab_weights(state: dict, target: TargetEmbeddings) -> dict:
    """Shipped embedding / LM-head copies: dropped when they equal the target's (shared, as vLLM does), else
    kept as the drafter's own."""
    theirs = {"embed_tokens.weight": target.embed_tokens, "lm_head.weight": target.lm_head}
    for name, tensor in theirs.items():
        if name in state and tuple(state[name].shape) == tuple(tensor.shape) and torch.equal(
                state[name].to(tensor.dtype), tensor.detach().cpu()):
            del state[name]
    return state

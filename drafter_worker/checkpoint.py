"""Drafter checkpoints: build, save and load draft models next to their target.

Layout: `config.json` (the target's config with the drafter's layer count and a `dspark_drafter`
section), `model.safetensors` (the drafter's own weights; embedding and LM head come from the target),
and `calibration.json` when confidences were calibrated.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from drafter_worker.block_model import BlockDraftModel
from drafter_worker.calibration import Calibration
from drafter_worker.chain_model import ChainDraftModel
from drafter_worker.config import DrafterConfig
from services.checkpoint import hf_config_dict
from services.errors import ModelLoadError
from services.loader import resolve_device, resolve_dtype
from services.model import CausalLM
from services.model_config import ModelConfig
from services.registry import resolve_model

DraftModel = BlockDraftModel | ChainDraftModel
_SHARED = ("embed_tokens.weight", "lm_head.weight")  # the target's, never stored with the drafter


def build_draft_model(dcfg: DrafterConfig, target: CausalLM) -> DraftModel:
    """A fresh draft model sharing (a frozen copy of) the target's embedding and LM head."""
    cls = BlockDraftModel if dcfg.method.is_block else ChainDraftModel
    model = cls(dcfg, target.config).to(device=target.device, dtype=target.dtype)
    model.embed_tokens.weight = torch.nn.Parameter(target.model.embed_tokens.weight.detach().clone(),
                                                   requires_grad=False)
    model.lm_head.weight = torch.nn.Parameter(target.lm_head.weight.detach().clone(), requires_grad=False)
    return model


def save_drafter(model: DraftModel, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                 calibration: Calibration | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items() if k not in _SHARED}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config_dict(model.config, dtype)
    config["num_hidden_layers"] = model.dconfig.num_layers
    config["dspark_drafter"] = model.dconfig.to_dict()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if calibration is not None:
        calibration.save(out / "calibration.json")
    return out


def drafter_config(model_dir: str | Path) -> DrafterConfig:
    path = Path(model_dir) / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    if "dspark_drafter" not in raw:
        raise ModelLoadError(f"{model_dir}: not a drafter checkpoint (no dspark_drafter in config.json)")
    try:
        return DrafterConfig.from_dict(raw["dspark_drafter"])
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{model_dir}: bad dspark_drafter config: {exc}") from exc


def load_drafter(name_or_dir: str | Path, target: CausalLM, dtype: str | torch.dtype = "auto",
                 device: str | torch.device | None = "cpu") -> tuple[DraftModel, Calibration | None]:
    """Load a drafter for an already loaded `target` (whose embedding and LM head it shares)."""
    model_dir = resolve_model(name_or_dir)
    dcfg = drafter_config(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    if (cfg.hidden_size, cfg.vocab_size) != (target.config.hidden_size, target.config.vocab_size):
        raise ModelLoadError(f"{model_dir}: drafter width/vocab {cfg.hidden_size}/{cfg.vocab_size} do not match "
                             f"the target's {target.config.hidden_size}/{target.config.vocab_size}")
    device = resolve_device(device)
    model = build_draft_model(dcfg, target).to(device=device, dtype=resolve_dtype(dtype, device))
    state = load_file(str(model_dir / "model.safetensors"))
    expected = {k for k in model.state_dict() if k not in _SHARED}
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ModelLoadError(f"{model_dir}: tensors missing {missing[:3]}, unexpected {extra[:3]}")
    model.load_state_dict(state, strict=False)
    calibration_path = model_dir / "calibration.json"
    calibration = Calibration.load(calibration_path) if calibration_path.is_file() else None
    return model.eval(), calibration

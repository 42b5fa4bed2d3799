"""Drafter checkpoint formats: dspark's own layout and the released ones, told apart by config.json.

`detect` names the format (or checks the one a user forces with `--drafter-format`); each foreign format's
module turns its config into a `DrafterConfig` and its tensor names into dspark's. The loader
(`drafter_worker/checkpoint.py`) builds the draft's layers from the draft's own config, never the target's.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import load_file

from services.errors import ModelLoadError

MTP_FORMATS = ("deepseek_mtp", "qwen3_next_mtp")  # MTP modules inside a target family's checkpoint
FORMATS = ("dspark", "deepspec", "eagle3", "dflash", *MTP_FORMATS)


def reader(fmt: str) -> ModuleType:
    """The module that reads a released format, imported when a checkpoint of it is met: dspark's own
    drafters (those shipped and served by default) load without any of them."""
    return importlib.import_module(f"drafter_worker.formats.{'mtp' if fmt in MTP_FORMATS else fmt}")


def read_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir}: no config.json")
    try:
        return json.loads(path.read_text())
    except ValueError as error:
        raise ModelLoadError(f"{path}: not valid JSON ({error})") from None


def detect(raw: dict, where: str, forced: str = "auto") -> str:
    """The checkpoint's format: `forced` when given (and plausible), else from its config."""
    if forced != "auto":
        if forced not in FORMATS:
            raise ModelLoadError(f"unknown drafter format {forced!r} (known: {', '.join(FORMATS)})")
        return forced
    if "dspark_drafter" in raw:
        return "dspark"
    found = next((name for name in ("deepspec", "eagle3", "dflash") if reader(name).matches(raw)), None)
    found = found or reader("mtp").matches(raw)
    if found is None:
        deepspec, eagle3, dflash = (reader(name) for name in ("deepspec", "eagle3", "dflash"))
        raise ModelLoadError(f"{where}: not a drafter checkpoint of a known format (architectures "
                             f"{raw.get('architectures')}; known: dspark's own config with dspark_drafter, "
                             "num_nextn_predict_layers with model_type deepseek_v3 / qwen3_next (MTP), "
                             f"DeepSpec {', '.join(deepspec.ARCHITECTURES)}, EAGLE-3 "
                             f"{', '.join(eagle3.ARCHITECTURES)}, z-lab/SpecForge {', '.join(dflash.ARCHITECTURES)})")
    return found


def declared_method(raw: dict, where: str, forced: str = "auto") -> str:
    """The method a checkpoint of any known format drafts with (no target needed)."""
    fmt = detect(raw, where, forced)
    if fmt == "dspark":
        return str(raw.get("dspark_drafter", {}).get("method"))
    if fmt == "eagle3":
        return "eagle3"
    if fmt in MTP_FORMATS:
        return "mtp"
    if fmt == "deepspec":
        return "dspark" if int(raw.get("markov_rank", 0)) > 0 else "dflash"
    return "dspark" if raw["architectures"][0] == "DSparkDraftModel" else "dflash"


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """`model.safetensors`, or the shards a `model.safetensors.index.json` lists."""
    model_dir = Path(model_dir)
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.is_file():
        return load_file(str(single))
    if not index.is_file():
        raise ModelLoadError(f"{model_dir}: neither model.safetensors nor model.safetensors.index.json")
    weight_map = json.loads(index.read_text()).get("weight_map", {})
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not (model_dir / shard).is_file():
            raise ModelLoadError(f"{model_dir}: shard {shard} listed in the index is missing")
        state.update(load_file(str(model_dir / shard)))
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise ModelLoadError(f"{model_dir}: tensors the index lists are in no shard: {missing[:3]}")
    return state

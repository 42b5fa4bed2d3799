"""Write a `CausalLM` in Hugging Face layout (config.json + model.safetensors) that transformers loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from services.model_config import hf_config_dict

if TYPE_CHECKING:
    from services.model import CausalLM


def save_model(model: CausalLM, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype or model.dtype
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(model.config, dtype), indent=2) + "\n")
    return out

"""The target's embeddings: its input table and its LM head, the two tensors every drafter shares with it.

A drafter reads nothing else of the target (its features arrive from the verifier), so a drafter replica loads
these two and not the decoder: for Gemma 3 270M in fp32 that is 0.67 GB instead of 1.07 GB, and the decoder's
code (services/model.py, services/gemma.py) is never imported there. Training and in-process generation hold the
whole target and pass it; `TargetEmbeddings.of` takes either.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from services.errors import ModelLoadError
from services.loader import open_checkpoint, tensor_index
from services.model_config import ModelConfig

_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


@dataclass(slots=True)
class TargetEmbeddings:
    config: ModelConfig
    embed_tokens: torch.Tensor  # [V, H] as the checkpoint stores it (Gemma scales after the lookup, not here)
    lm_head: torch.Tensor  # [V, H]; the very tensor `embed_tokens` is where the target ties them

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.device

    @staticmethod
    def of(target) -> TargetEmbeddings:
        """A loaded target's embeddings (the same tensors, not copies), or `target` itself if it is already one."""
        if isinstance(target, TargetEmbeddings):
            return target
        return TargetEmbeddings(target.config, target.model.embed_tokens.weight, target.lm_head.weight)


def load_embeddings(model_dir: str | Path, dtype: str | torch.dtype = "auto",
                    device: str | torch.device | None = "cpu") -> TargetEmbeddings:
    """The two tensors from a Hugging Face checkpoint, in `dtype` on `device`, checked against its config."""
    model_dir, cfg, dtype, device = open_checkpoint(model_dir, dtype, device)
    files = tensor_index(model_dir)
    names = [_EMBED] if cfg.tie_word_embeddings else [_EMBED, _HEAD]
    loaded = {}
    for name in names:
        if name not in files:
            raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
        with safe_open(files[name], framework="pt") as f:
            tensor = f.get_tensor(name)
        if tuple(tensor.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{(cfg.vocab_size, cfg.hidden_size)}")
        loaded[name] = tensor.to(device=device, dtype=dtype)
    return TargetEmbeddings(cfg, loaded[_EMBED], loaded.get(_HEAD, loaded[_EMBED]))

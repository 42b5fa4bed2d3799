"""Write a `CausalLM` in Hugging Face layout (config.json + model.safetensors) that transformers loads."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.model import CausalLM
from services.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    rope = {"rope_type": cfg.rope.rope_type, "rope_theta": cfg.rope.theta}
    if cfg.rope.rope_type != "default":
        rope["factor"] = cfg.rope.factor
    if cfg.rope.rope_type == "llama3":
        rope.update(
            low_freq_factor=cfg.rope.low_freq_factor,
            high_freq_factor=cfg.rope.high_freq_factor,
            original_max_position_embeddings=cfg.rope.original_max_position_embeddings,
        )
    eos = list(cfg.eos_token_ids)
    return {
        "architectures": [cfg.architecture],
        "model_type": SUPPORTED_ARCHITECTURES[cfg.architecture],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope.theta,
        "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.qkv_bias,
        "mlp_bias": cfg.mlp_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": _DTYPE_NAMES[dtype],
    }


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

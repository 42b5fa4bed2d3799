"""A small random-weight Llama with a real byte-level BPE tokenizer, for demos and smoke tests.

Its output is not meaningful text; it exercises every code path (loader, tokenizer, engine,
speculation) in seconds on any machine, before a trained model is at hand.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer

from services.chat_template import EOS, PAD
from services.checkpoint import save_model
from services.model import CausalLM
from services.model_config import ModelConfig, RopeConfig
from training.data.tokenizer_build import train_byte_bpe


def _stdlib_tokenizer(vocab_size: int, max_files: int = 40) -> Tokenizer:
    """Byte-level BPE trained on a deterministic slice of the standard library sources."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:max_files]
    texts = (f.read_text(encoding="utf-8", errors="replace") for f in files)
    return train_byte_bpe(texts, vocab_size, (EOS, PAD))


def tiny_config(vocab_size: int, eos_id: int, layers: int = 4, hidden: int = 256) -> ModelConfig:
    heads = max(1, hidden // 64)
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=hidden // heads,
        rope=RopeConfig(theta=10000.0),
        max_position_embeddings=2048,
        eos_token_ids=(eos_id,),
    )


def random_model(cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, std)
    return model.eval()


def build_tiny_model(out_dir: str | Path, seed: int = 0, vocab_size: int = 2048, layers: int = 4) -> Path:
    out = Path(out_dir)
    tok = _stdlib_tokenizer(vocab_size)
    eos_id = tok.token_to_id(EOS)
    model = random_model(tiny_config(tok.get_vocab_size(), eos_id, layers=layers), seed)
    save_model(model, out, torch.bfloat16)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOS, "pad_token": PAD, "add_bos_token": False}, indent=2) + "\n"
    )
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}, indent=2) + "\n")
    return out

"""What the drafter-format tests share: the tiny Qwen3 target (odd sizes: head_dim ≠ d / H, Hkv ≠ H), random
weights, and the reference primitives written from the formats' definitions (RMSNorm, rotate-half RoPE)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.model import CausalLM
from services.model_config import ModelConfig

D, H, HKV, DH, FF, V, LAYERS, TAPS, EPS, THETA = 64, 4, 2, 32, 96, 384, 8, (1, 3, 6), 1e-6, 1e6
MASK, BLOCK, RANK, DRAFT_LAYERS = 360, 7, 16, 2

TARGET_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": V, "hidden_size": D,
                 "intermediate_size": FF, "num_hidden_layers": LAYERS, "num_attention_heads": H,
                 "num_key_value_heads": HKV, "head_dim": DH, "rms_norm_eps": EPS, "rope_theta": THETA,
                 "max_position_embeddings": 256, "tie_word_embeddings": False, "attention_bias": False,
                 "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}


def tiny_target(taps: tuple[int, ...] = TAPS) -> CausalLM:
    """`taps`: (LAYERS,) taps the final normed hidden (what MTP modules read)."""
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_dict(TARGET_CONFIG), taps).float()
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    return model.eval()


def save_target(path: Path, model: CausalLM) -> Path:
    """The tiny target in Hugging Face layout at `path` (config.json + model.safetensors), for CLI conversions."""
    (path / "config.json").write_text(json.dumps(TARGET_CONFIG))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    return path


def norm_weight(g, n):
    return 1 + 0.1 * torch.randn(n, generator=g)


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rope(x, pos, theta=THETA):  # x [n, heads, Dh] at positions pos [n]: rotate-half RoPE
    inv = 1.0 / theta ** (torch.arange(0, DH, 2, dtype=torch.float64) / DH)
    ang = pos[:, None].double() * inv[None]  # [n, Dh/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None]  # [n, 1, Dh]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None]
    half = torch.cat([-x[..., DH // 2:], x[..., : DH // 2]], -1)
    return x * cos + half * sin


def context(seed: int = 5) -> tuple[torch.Tensor, list[int]]:
    """Random context features [11, T·d] (positions 0..10) and 12 committed token ids (the anchor last)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(11, len(TAPS) * D, generator=g), torch.randint(4, 300, (12,), generator=g).tolist()


def assert_greedy_is_plain(target: CausalLM, draft_model, gamma: int) -> None:
    """Greedy speculative decoding with this drafter gives plain greedy's tokens, and drafts were verified."""
    from drafter_worker.drafter import Drafter
    from in_process.generation import GenerationRequest, InProcessRouter
    from router.scheduling.policy import Policy
    from services.types import SamplingParams
    from tests.conftest import make_engine

    g = torch.Generator().manual_seed(9)
    requests = [GenerationRequest(f"r{i}", torch.randint(4, 300, (n,), generator=g).tolist(),
                                  SamplingParams(max_tokens=16)) for i, n in enumerate((5, 12))]
    plain = InProcessRouter(make_engine(target), policy=Policy.NONE).generate(requests)
    spec = InProcessRouter(make_engine(target), Drafter(draft_model), Policy.FIXED, gamma).generate(requests)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain] and sum(r.draft_tokens for r in spec) > 0

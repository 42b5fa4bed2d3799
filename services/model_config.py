"""The target architecture read from a Hugging Face `config.json`.

Only the fields that change the computation are kept. Both config dialects are read: transformers 4
(`rope_theta` + `rope_scaling`) and transformers 5 (`rope_parameters`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from services.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 scaling only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def max_context(self) -> int:
        """Longest sequence this deployment serves exactly (a sliding window caps it)."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        arch = _architecture(raw)
        model_type = SUPPORTED_ARCHITECTURES[arch]
        heads = _required(raw, "num_attention_heads")
        hidden = _required(raw, "hidden_size")
        head_dim = raw.get("head_dim") or hidden // heads
        qkv_bias, o_bias = _attention_biases(raw, model_type)
        use_window = raw.get("use_sliding_window", model_type == "mistral")
        eos = raw.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=_required(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(raw, "intermediate_size"),
            num_hidden_layers=_required(raw, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=raw.get("sliding_window") if use_window else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw)


def _architecture(raw: dict) -> str:
    archs = raw.get("architectures") or []
    if archs:
        arch = archs[0]
    else:
        by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
        arch = by_type.get(raw.get("model_type", ""), raw.get("model_type", "<missing>"))
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise ModelLoadError(f"unsupported architecture {arch!r}; supported: {supported}")
    return arch


def _attention_biases(raw: dict, model_type: str) -> tuple[bool, bool]:
    """(q/k/v bias, o bias): Qwen2 has q/k/v bias only; Mistral none; Llama and Qwen3 follow the flag."""
    if model_type == "qwen2":
        return True, False
    if model_type == "mistral":
        return False, False
    flag = bool(raw.get("attention_bias", False))
    return flag, flag


def _required(raw: dict, key: str) -> int:
    if key not in raw:
        raise ModelLoadError(f"config.json lacks required field {key!r}")
    return int(raw[key])


def _rope(raw: dict) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def default_tap_layers(num_layers: int) -> tuple[int, ...]:
    """The feature taps both tiers agree on by default: low, middle and high decoder-layer outputs, never the
    last layer (EAGLE-3's three taps)."""
    if num_layers < 4:
        return tuple(range(num_layers))
    return tuple(sorted({1, num_layers // 2, num_layers - 2}))

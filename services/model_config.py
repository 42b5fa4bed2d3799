"""The target architecture read from a Hugging Face `config.json`.

Only the fields that change the computation are kept. Both config dialects are read: transformers 4
(`rope_theta` + `rope_scaling`) and transformers 5 (`rope_parameters`). Gemma 3's own fields are kept in a
`GemmaSpec`; anything Gemma-shaped this engine would compute differently is refused by name.
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
    "Gemma3ForCausalLM": "gemma3_text",
}
# Named so a user learns why, instead of a bare "unsupported architecture".
REFUSED_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "the multimodal Gemma 3 checkpoint (vision tower, language model under "
    "model.language_model.*) is not loaded; export its text model as Gemma3ForCausalLM",
    "Gemma2ForCausalLM": "Gemma 2's attn_logit_softcapping (tanh inside the softmax) has no SDPA form, and "
    "attention here is one SDPA call per layer",
    "GemmaForCausalLM": "Gemma 1 is not supported (Gemma3ForCausalLM is)",
    "Gemma4ForCausalLM": "Gemma 4's per-layer input embeddings, KV-shared layers, global head_dim and MoE "
    "blocks are not implemented (Gemma3ForCausalLM is)",
    "Gemma4ForConditionalGeneration": "Gemma 4 is not supported (Gemma3ForCausalLM is)",
}
GEMMA_LAYER_TYPES = ("sliding_attention", "full_attention")
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)
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
class GemmaSpec:
    """What a Gemma 3 decoder computes beyond a Llama one (HF `Gemma3TextConfig`)."""

    query_pre_attn_scalar: float  # softmax scale is its inverse square root, not head_dim's
    sliding_window: int  # a sliding layer's row at position p sees keys in (p - window, p]
    sliding_layers: tuple[bool, ...]  # [L] True where the layer attends a sliding window
    local_rope: RopeConfig  # the sliding layers' RoPE (`rope_local_base_freq`); global layers use `rope`
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) where set


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
    hidden_act: str = "silu"  # the gated MLP's activation: silu (SwiGLU) or, Gemma, gelu_pytorch_tanh (GeGLU)
    gemma: GemmaSpec | None = None  # Gemma 3: scaled embeddings, (1 + w) norms, four norms a layer, windows

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
        gemma = model_type == "gemma3_text"
        # Gemma ties its head unless told otherwise (HF's default); its windows are per layer (`GemmaSpec`),
        # not the whole-model cap `sliding_window` stands for here.
        tie = bool(raw.get("tie_word_embeddings", gemma))
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
            rope=_gemma_ropes(raw)[0] if gemma else _rope(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=tie,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            sliding_window=raw.get("sliding_window") if use_window else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            hidden_act=_gemma_activation(raw) if gemma else "silu",
            gemma=_gemma(raw, _required(raw, "num_hidden_layers")) if gemma else None,
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


def hf_config_dict(cfg: ModelConfig, dtype) -> dict:
    """`cfg` as a transformers `config.json` (the inverse of `ModelConfig.from_dict`), weights in `dtype` (a
    torch dtype)."""
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
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _architecture(raw: dict) -> str:
    archs = raw.get("architectures") or []
    if archs:
        arch = archs[0]
    else:
        by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
        arch = by_type.get(raw.get("model_type", ""), raw.get("model_type", "<missing>"))
    if arch in REFUSED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r}: {REFUSED_ARCHITECTURES[arch]}")
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


def _gemma_ropes(raw: dict) -> tuple[RopeConfig, RopeConfig]:
    """(global, sliding) layers' RoPE. transformers 5 nests `rope_parameters` by layer type; transformers 4 has
    `rope_theta` + `rope_scaling` for the global layers and `rope_local_base_freq` for the sliding ones, which
    are never scaled. HF's defaults: theta 1e6 global, 1e4 local."""
    params = raw.get("rope_parameters") or {}
    if any(kind in params for kind in GEMMA_LAYER_TYPES):
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        return (_rope({"rope_parameters": {"rope_theta": 1e6, **full}}),
                _rope({"rope_parameters": {"rope_theta": 1e4, **local}}))
    return (_rope({**raw, "rope_theta": raw.get("rope_theta", 1e6)}),
            RopeConfig(theta=float(raw.get("rope_local_base_freq", 1e4))))


def _gemma_activation(raw: dict) -> str:
    act = raw.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in GEMMA_ACTIVATIONS:
        raise ModelLoadError(f"Gemma hidden_activation {act!r} is not supported; supported: {GEMMA_ACTIVATIONS}")
    return act


def _gemma(raw: dict, num_layers: int) -> GemmaSpec:
    """The Gemma 3 fields, each one this engine would compute differently refused by name."""
    if raw.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(f"Gemma attn_logit_softcapping={raw['attn_logit_softcapping']} is not supported "
                             "(a tanh inside the softmax has no SDPA form)")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError("Gemma use_bidirectional_attention=true is not supported (a causal decoder serves)")
    types = raw.get("layer_types")
    if types is None:  # transformers 4 checkpoints: every `sliding_window_pattern`-th layer is global
        pattern = int(raw.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    unknown = [kind for kind in types if kind not in GEMMA_LAYER_TYPES]
    if unknown:
        raise ModelLoadError(f"Gemma layer_types entry {unknown[0]!r} is not supported; supported: "
                             f"{GEMMA_LAYER_TYPES}")
    if len(types) != num_layers:
        raise ModelLoadError(f"Gemma layer_types has {len(types)} entries for {num_layers} layers")
    sliding = tuple(kind == "sliding_attention" for kind in types)
    window = raw.get("sliding_window")
    if any(sliding) and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ModelLoadError(f"Gemma sliding_window={window!r}: sliding layers need a positive window")
    cap = raw.get("final_logit_softcapping")
    if cap is not None and not float(cap) > 0:
        raise ModelLoadError(f"Gemma final_logit_softcapping={cap!r} must be positive or null")
    scalar = float(raw.get("query_pre_attn_scalar", 256))
    if not scalar > 0:
        raise ModelLoadError(f"Gemma query_pre_attn_scalar={scalar} must be positive")
    return GemmaSpec(query_pre_attn_scalar=scalar, sliding_window=int(window) if any(sliding) else 0,
                     sliding_layers=sliding, local_rope=_gemma_ropes(raw)[1],
                     final_logit_softcapping=None if cap is None else float(cap))


def default_tap_layers(num_layers: int) -> tuple[int, ...]:
    """The feature taps both tiers agree on by default: low, middle and high decoder-layer outputs, never the
    last layer (EAGLE-3's three taps)."""
    if num_layers < 4:
        return tuple(range(num_layers))
    return tuple(sorted({1, num_layers // 2, num_layers - 2}))

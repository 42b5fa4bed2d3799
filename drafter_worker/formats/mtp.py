"""MTP modules inside released checkpoints: DeepSeek-V3 (`deepseek_mtp`) and Qwen3-Next (`qwen3_next_mtp`).

The format (docs/drafters.md, Released checkpoint formats §5; vLLM `deepseek_mtp.py`, `qwen3_next_mtp.py`): the
*target's* checkpoint, whose config.json has `num_nextn_predict_layers` ≥ 1.
- DeepSeek-V3 (`model_type` deepseek_v3): module L = num_hidden_layers lives at `model.layers.{L}.*`:
  `enorm`, `hnorm`, `eh_proj` [d, 2d] (input [emb; hidden]), `shared_head.norm`, `shared_head.head` and
  `embed_tokens` (copies of the target's), and a decoder block (MLA attention, MoE MLP). Weights may be FP8
  e4m3 with `weight_scale_inv` block scales (`quantization_config.weight_block_size`, 128×128): dequantized
  here at load.
- Qwen3-Next (`model_type` qwen3_next): `mtp.fc` [d, 2d] (input [emb; hidden]), `mtp.pre_fc_norm_embedding`,
  `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` (gated full attention, sparse MoE with a gated shared expert),
  `mtp.norm`; every norm zero-centred, y = x̂·(1 + w), loaded as w + 1. Embedding and head: the main
  `model.embed_tokens` / `lm_head`.
Both condition on the target's final hidden state after its final norm (what vLLM's target forward returns
and feeds the MTP module): dspark's tap L (`services/model.py`). Only the module's tensors are read (a
671B checkpoint's other shards are never opened); the main model's own tensors are the target's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from drafter_worker.config import DrafterConfig, Method
from drafter_worker.formats.mtp_layers import GatedDims, MlaDims, Yarn
from drafter_worker.formats.mtp_model import MtpConfig, MtpDraftModel
from drafter_worker.formats.mtp_moe import MoeDims
from services.errors import ModelLoadError
from services.loader import unfilled

_MODEL_TYPES = {"deepseek_v3": "deepseek_mtp", "qwen3_next": "qwen3_next_mtp"}
_FP8 = (torch.float8_e4m3fn,)


def matches(raw: dict) -> str | None:
    """The MTP format of a config.json, or None."""
    if int(raw.get("num_nextn_predict_layers") or 0) < 1:
        return None
    return _MODEL_TYPES.get(raw.get("model_type", ""))


def _need(raw: dict, key: str, where: str):
    if raw.get(key) is None:
        raise ModelLoadError(f"{where}: MTP config.json lacks {key}")
    return raw[key]


def _refuse(raw: dict, where: str, **allowed) -> None:
    """Fields whose other values change the computation in ways not implemented here."""
    for key, ok in allowed.items():
        if raw.get(key, ok[0]) not in ok:
            raise ModelLoadError(f"{where}: {key} {raw.get(key)!r} is not supported (only {list(ok)})")


def _rope(raw: dict) -> tuple[float, dict]:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0))), params


def drafter_config(raw: dict, where: str, target_layers: int | None) -> DrafterConfig:
    """One draft per cycle from the target's final hidden (tap L); the module must belong to this target."""
    layers = int(_need(raw, "num_hidden_layers", where))
    if int(raw.get("num_nextn_predict_layers", 1)) != 1:
        raise ModelLoadError(f"{where}: num_nextn_predict_layers {raw['num_nextn_predict_layers']}: only one "
                             "MTP module is supported")
    if target_layers is not None and target_layers != layers:
        raise ModelLoadError(f"{where}: num_hidden_layers {layers}: this MTP module follows a {layers}-layer "
                             f"model, the target has {target_layers}")
    return DrafterConfig(Method.MTP, raw.get("_name_or_path", ""), (layers,), num_layers=1, block_size=1)


def model_config(raw: dict, fmt: str, where: str, max_positions: int) -> MtpConfig:
    _refuse(raw, where, hidden_act=("silu",), attention_bias=(False,))
    eps = float(raw.get("rms_norm_eps", 1e-6))
    theta, params = _rope(raw)
    if fmt == "deepseek_mtp":
        _refuse(raw, where, scoring_func=("sigmoid",), topk_method=("noaux_tc",))
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ("default", "yarn"):
            raise ModelLoadError(f"{where}: rope_scaling type {kind!r} is not supported (default, yarn)")
        yarn = Yarn() if kind == "default" else Yarn(
            float(params["factor"]), int(params.get("original_max_position_embeddings", 4096)),
            float(params.get("beta_fast", 32)), float(params.get("beta_slow", 1)),
            float(params.get("mscale", 1.0)), float(params.get("mscale_all_dim", 0.0)))
        q_rank = raw.get("q_lora_rank")
        attn = MlaDims(int(_need(raw, "num_attention_heads", where)), None if q_rank is None else int(q_rank),
                       int(_need(raw, "kv_lora_rank", where)), int(_need(raw, "qk_nope_head_dim", where)),
                       int(_need(raw, "qk_rope_head_dim", where)), int(_need(raw, "v_head_dim", where)),
                       theta, yarn, eps)
        experts, groups = int(_need(raw, "n_routed_experts", where)), int(raw.get("n_group") or 1)
        if experts % groups or not 1 <= int(raw.get("topk_group") or 1) <= groups:
            raise ModelLoadError(f"{where}: n_routed_experts {experts}, n_group {groups}, topk_group "
                                 f"{raw.get('topk_group')} are inconsistent")
        width = int(_need(raw, "moe_intermediate_size", where))
        moe = MoeDims(experts, int(_need(raw, "num_experts_per_tok", where)), width,
                      width * int(_need(raw, "n_shared_experts", where)), bool(raw.get("norm_topk_prob", False)),
                      float(raw.get("routed_scaling_factor", 1.0)), groups, int(raw.get("topk_group") or 1))
    else:
        if params.get("rope_type", params.get("type", "default")) != "default":
            raise ModelLoadError(f"{where}: rope scaling {params} is not supported for Qwen3-Next MTP")
        head_dim = int(_need(raw, "head_dim", where))
        partial = float(raw.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)))
        attn = GatedDims(int(_need(raw, "num_attention_heads", where)), int(_need(raw, "num_key_value_heads", where)),
                         head_dim, int(head_dim * partial), theta, eps)
        moe = MoeDims(int(_need(raw, "num_experts", where)), int(_need(raw, "num_experts_per_tok", where)),
                      int(_need(raw, "moe_intermediate_size", where)),
                      int(_need(raw, "shared_expert_intermediate_size", where)), bool(raw.get("norm_topk_prob", True)))
    if moe.top_k > moe.experts:
        raise ModelLoadError(f"{where}: num_experts_per_tok {moe.top_k} > {moe.experts} experts")
    return MtpConfig(fmt, int(_need(raw, "vocab_size", where)), int(_need(raw, "hidden_size", where)), eps, attn,
                     moe, max_positions, int(raw["num_hidden_layers"]))


def build(raw: dict, model_dir: Path, fmt: str, dcfg: DrafterConfig, target) -> tuple[MtpDraftModel, dict]:
    """The module as a draft model next to `target` (its `TargetEmbeddings`; its context length), and its
    tensors under the model's names. Built on the meta device: every parameter is then loaded or shared, and
    a DeepSeek-V3 module (~11B parameters) is never initialised at random first."""
    where, tcfg = str(model_dir), target.config
    cfg = model_config(raw, fmt, where, tcfg.max_context)
    if (cfg.hidden_size, cfg.vocab_size) != (tcfg.hidden_size, tcfg.vocab_size):
        raise ModelLoadError(f"{where}: MTP width/vocab {cfg.hidden_size}/{cfg.vocab_size} do not match the "
                             f"target's {tcfg.hidden_size}/{tcfg.vocab_size}")
    with unfilled():
        model = MtpDraftModel(dcfg, cfg)
    model = model.to_empty(device=target.device).to(target.dtype)
    for mine, theirs in ((model.embed_tokens, target.embed_tokens), (model.lm_head, target.lm_head)):
        mine.weight = torch.nn.Parameter(theirs.detach().clone(), requires_grad=False)
    return model, read_module(model_dir, fmt, cfg, target.dtype, raw)


# ---- tensors ----------------------------------------------------------------------------------------------
def _prefix(fmt: str, cfg: MtpConfig) -> str:
    return f"model.layers.{cfg.target_layers}." if fmt == "deepseek_mtp" else "mtp."


def _wanted(fmt: str, cfg: MtpConfig):
    prefix = _prefix(fmt, cfg)
    extra = () if fmt == "deepseek_mtp" else ("model.embed_tokens.weight", "lm_head.weight")
    return lambda name: name.startswith(prefix) or name in extra


def read_module(model_dir: Path, fmt: str, cfg: MtpConfig, dtype: torch.dtype, raw: dict) -> dict:
    """The module's tensors under dspark's names, FP8 blocks dequantized to `dtype`."""
    where, wanted = str(model_dir), _wanted(fmt, cfg)
    state = {}
    for file, names in _files(Path(model_dir), wanted).items():
        with safe_open(str(file), "pt") as f:
            for name in names if names is not None else filter(wanted, f.keys()):
                state[name] = f.get_tensor(name)
    if not state:
        raise ModelLoadError(f"{where}: no tensor under {_prefix(fmt, cfg)} (the MTP module is not in this checkpoint)")
    block = tuple((raw.get("quantization_config") or {}).get("weight_block_size") or (128, 128))
    return rename(dequantize_all(state, block, dtype, where), fmt, cfg, where)


def _files(model_dir: Path, wanted) -> dict[Path, list[str] | None]:
    """Safetensors files → the wanted names in each (None: filter while reading): with an index, only the
    shards that hold module tensors are opened (or need to be there at all)."""
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.is_file():
        return {single: None}
    if not index.is_file():
        raise ModelLoadError(f"{model_dir}: neither model.safetensors nor model.safetensors.index.json")
    files: dict[Path, list[str]] = {}
    for name, shard in json.loads(index.read_text()).get("weight_map", {}).items():
        if wanted(name):
            files.setdefault(model_dir / shard, []).append(name)
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"{model_dir}: shard {file.name} listed in the index is missing")
    return files


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str) -> torch.Tensor:
    """FP8 weight [out, in] with block scales [⌈out/bo⌉, ⌈in/bi⌉] → fp32 weight · scale of its block."""
    out, inp = weight.shape
    expected = (math.ceil(out / block[0]), math.ceil(inp / block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ModelLoadError(f"{name}_scale_inv {list(scale_inv.shape)}: expected {list(expected)} for a "
                             f"{list(weight.shape)} weight in {block[0]}×{block[1]} blocks")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]
    return weight.float() * scale


def dequantize_all(state: dict, block: tuple[int, int], dtype: torch.dtype, where: str) -> dict:
    for name in [n for n in state if n.endswith(".weight_scale_inv")]:
        base = name.removesuffix("_scale_inv")
        if base not in state:
            raise ModelLoadError(f"{where}: {name} without its weight {base}")
        state[base] = dequantize(state[base], state.pop(name), block, f"{where}: {base}").to(dtype)
    fp8 = [n for n, t in state.items() if t.dtype in _FP8]
    if fp8:
        raise ModelLoadError(f"{where}: FP8 tensor {fp8[0]} has no weight_scale_inv")
    return state


def rename(state: dict, fmt: str, cfg: MtpConfig, where: str) -> dict:
    """Checkpoint names → MtpDraftModel's; every name under the module's prefix is mapped or refused."""
    prefix, out = _prefix(fmt, cfg), {}
    top = ({"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj.", "shared_head.norm.": "norm.",
            "shared_head.head.": "lm_head.", "embed_tokens.": "embed_tokens."} if fmt == "deepseek_mtp" else
           {"pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.", "fc.": "eh_proj.", "norm.": "norm.",
            "layers.0.": "layer."})
    for name, tensor in state.items():
        if fmt == "qwen3_next_mtp" and not name.startswith(prefix):  # main model.embed_tokens / lm_head
            out[name.removeprefix("model.")] = tensor
            continue
        rest = name[len(prefix):]
        if rest.endswith("rotary_emb.inv_freq"):  # recomputed from the config
            continue
        hit = next((k for k in top if rest.startswith(k)), None)
        if hit is not None:
            new = top[hit] + rest[len(hit):]
        elif fmt == "deepseek_mtp" and rest.split(".")[0] in ("self_attn", "mlp", "input_layernorm",
                                                               "post_attention_layernorm"):
            new = "layer." + rest
        else:
            raise ModelLoadError(f"{where}: unexpected tensor {name!r} for a {fmt} module")
        if fmt == "qwen3_next_mtp" and new.endswith("norm.weight"):  # zero-centred: y = x̂ · (1 + w)
            tensor = tensor.float() + 1
        out[new] = tensor
    return out

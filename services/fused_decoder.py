"""The CPU serving path's decoder layers: each one call of the project's kernel (services/kernels/decoder.cpp).

A decode or verify step of target v2 spends more in dispatch than in arithmetic when each layer is a few
hundred aten calls; in one C++ call per layer the step costs its GEMMs and little else. The kernel computes
every row alone (a row's bits do not depend on the step's other rows: batch invariant, as greedy speculation
needs), but not with the module path's bits: a model serves on one path or the other for all its steps, which
`CausalLM.prepare_for_serving` decides once (`serves`). `DSPARK_FUSED_DECODER=0` keeps the module path.

What it serves: Llama-family layers as `services/layers.py` builds them (fused q/k/v and gate/up, SiLU, RMSNorm
of one eps, biases allowed, head_dim a multiple of 32), in bf16 where the CPU has AVX512-BF16 and fp32 with
AVX2; not Gemma, q/k norms or tensor-parallel shards (their layers are not these modules).
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from services import cpu_kernels
from services.layers import MLP, Attention, DecoderLayer
from services.packed_linear import PackedLinear, kernel_weight

_PLAIN_LINEAR = (nn.Linear, PackedLinear)


def serves(model) -> bool:
    """Whether every decoder layer of `model` (a prepared `CausalLM`) runs on the kernel."""
    cfg = model.config
    if cfg.gemma is not None or cfg.qk_norm or not kernel_serves(cfg, model.lm_head.weight):
        return False
    return all(plain(layer, cfg) for layer in model.model.layers)


def kernel_serves(cfg, weight: torch.Tensor) -> bool:
    """What every model on the kernel needs (the target's layers and the drafters'): not turned off
    (`DSPARK_FUSED_DECODER=0`), a CPU weight of a dtype the kernel serves here, head_dim a multiple of 32 up to
    256."""
    if os.environ.get("DSPARK_FUSED_DECODER", "1") == "0" or weight.device.type != "cpu":
        return False
    return cfg.head_dim % 32 == 0 and cfg.head_dim <= 256 and cpu_kernels.available(weight.dtype)


def plain(layer: nn.Module, cfg, kinds: tuple[type, type] = (DecoderLayer, Attention)) -> bool:
    """Whether the kernel computes `layer`: of the classes `kinds` (layer, attention; a block drafter's are
    its own, with the same parts), fused, SiLU, one dtype, all heads."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(layer) is not kinds[0] or type(attn) is not kinds[1] or type(mlp) is not MLP:
        return False
    if getattr(attn, "qk_norm", False):
        return False
    if attn.qkv_weight is None or mlp.gate_up_weight is None or mlp.act is not F.silu or attn.scale is not None:
        return False
    if (attn.n_heads, attn.n_kv) != (cfg.num_attention_heads, cfg.num_key_value_heads):
        return False  # a shard's heads
    if type(attn.o_proj) not in _PLAIN_LINEAR or type(mlp.down_proj) not in _PLAIN_LINEAR:
        return False
    norms = [n for n in (layer._modules.get("input_layernorm"), layer.post_attention_layernorm) if n is not None]
    tensors = [*(n.weight for n in norms), attn.qkv_weight, attn.o_proj.weight, mlp.gate_up_weight,
               mlp.down_proj.weight]
    dtype = tensors[0].dtype
    return len({n.eps for n in norms}) == 1 and all(t.dtype == dtype and t.is_contiguous() for t in tensors)


def run_layer(
    layer: DecoderLayer,
    x: torch.Tensor,  # [N, d] model dtype
    cos: torch.Tensor,  # [N, Dh] fp32, at the rows' positions
    sin: torch.Tensor,  # [N, Dh] fp32
    k_cache: torch.Tensor,  # [S, Hkv, L, Dh] this layer's keys
    v_cache: torch.Tensor,  # [S, Hkv, L, Dh]
    slots: torch.Tensor,  # [N] int64, each row's cache slot
    positions: torch.Tensor,  # [N] int64, each row's position (where its key is written; it sees 0..it)
    visible: torch.Tensor | None = None,  # [N] int64, the last key each row sees where not its own position
    normed: torch.Tensor | None = None,  # [N, d_in] the attention's input where not RMSNorm(x) (chain drafters)
) -> torch.Tensor:
    """One layer → its output [N, d]; the rows' keys and values are written into the caches (all of them
    before any row attends, so a draft block's rows can see each other through `visible`)."""
    weights, shape = _weights(layer)
    return cpu_kernels.decoder_layer(x.contiguous(), *weights, cos, sin, k_cache, v_cache, slots, positions, visible,
                                     None if normed is None else normed.contiguous(), *shape)


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` of an RMSNorm module in one kernel call (the module path is eight aten calls)."""
    return cpu_kernels.rms_norm(x, norm.weight, norm.eps)


# Per layer, its weights as the kernel takes them: walking a layer's modules for them costs 15 µs, a third of the
# kernel itself at one row. Kept while current: the fused buffers are the same objects (`.to()` replaces them),
# the packed weights' `current` holds (an in-place change or a new storage makes them stale); parameters are
# held as themselves, so a `.to()` that swaps their data reaches the kernel anyway.
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weights(layer: nn.Module) -> tuple[tuple, tuple]:
    """→ (the kernel's weight arguments, (heads, kv heads, eps, softmax scale))."""
    attn, mlp = layer._modules["self_attn"], layer._modules["mlp"]  # not Module.__getattr__'s slow path
    memo = _MEMO.get(layer)
    if memo is not None:
        qkv, gate_up, checks, weights, shape = memo
        if attn._buffers.get("qkv_weight") is qkv and mlp._buffers.get("gate_up_weight") is gate_up and all(
                packed is None or packed.current(w) for w, packed in checks):
            return weights, shape
    o_packed, down_packed = getattr(attn.o_proj, "packed", None), getattr(mlp.down_proj, "packed", None)
    ln1 = layer._modules.get("input_layernorm")
    ln1 = layer.post_attention_layernorm if ln1 is None else ln1  # EAGLE-3 has none: `normed` replaces it
    weights = (ln1.weight, kernel_weight(attn.qkv_weight, attn.qkv_packed), attn.qkv_bias,
               kernel_weight(attn.o_proj.weight, o_packed), attn.o_proj.bias, layer.post_attention_layernorm.weight,
               kernel_weight(mlp.gate_up_weight, mlp.gate_up_packed), mlp.gate_up_bias,
               kernel_weight(mlp.down_proj.weight, down_packed), mlp.down_proj.bias)
    checks = ((attn.qkv_weight, attn.qkv_packed), (attn.o_proj.weight, o_packed),
              (mlp.gate_up_weight, mlp.gate_up_packed), (mlp.down_proj.weight, down_packed))
    shape = (attn.n_heads, attn.n_kv, layer.post_attention_layernorm.eps, attn.head_dim ** -0.5)
    _MEMO[layer] = (attn.qkv_weight, mlp.gate_up_weight, checks, weights, shape)
    return weights, shape

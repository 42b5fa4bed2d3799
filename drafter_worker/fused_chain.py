"""Chain drafters (EAGLE-3, MTP) on the CPU serving kernel: each of a block's γ steps is one kernel call.

A chain step is one causal decoder row per request: the pair (hidden of the row before, embedding of the
token just drafted) at position anchor + k − 1, attending to the context rows and the block's earlier draft
rows. On the module path a step is some sixty aten calls; here the layer is services/kernels/decoder.cpp's,
given the layer's own attention input (`ChainLayer.inputs`: EAGLE-3's [emb; hidden] is 2d wide and has no
input norm, MTP's is RMSNorm(proj(…))) and the residual. A draft row writes its key at its own position in the
request's `ContextCache` slot, past the context: it is read by the block's later rows and overwritten when
the next features are folded in, as the module path's draft rows are dropped. Context rows run through the
same call (causal, positions start..), so `last_out` and the cached keys are the kernel's too.

`DSPARK_FUSED_DECODER=0` keeps the module path.
"""

from __future__ import annotations

import torch

from drafter_worker.chain_model import ChainDraftModel
from drafter_worker.context_cache import ContextCache
from drafter_worker.layers import ChainLayer, DraftAttention
from services import fused_decoder


def serves(model) -> bool:
    """Whether `model`'s rows run on the kernel here (a chain model on the CPU, its layer after `prepare`)."""
    if type(model) is not ChainDraftModel or not fused_decoder.kernel_serves(model.config, model.lm_head.weight):
        return False
    return fused_decoder.plain(model.layer, model.config, (ChainLayer, DraftAttention))


def prepare(model) -> None:
    """Fuse the layer's q/k/v and gate/up weights (checkpoint names unchanged), before they are packed; models of
    other classes (a converted MTP layer of its own kind) are left as they are."""
    if type(model) is ChainDraftModel and type(model.layer.self_attn) is DraftAttention:
        model.layer.self_attn.fuse()
        model.layer.mlp.fuse()


def rows(
    model: ChainDraftModel,
    cache: ContextCache,
    hidden: torch.Tensor,  # [N, d] each row's hidden (target features, or the drafter's own output)
    next_tokens: torch.Tensor,  # [N] int64 the token each row pairs it with
    positions: torch.Tensor,  # [N] int64
    slots: torch.Tensor,  # [N] int64
) -> torch.Tensor:
    """Causal rows through the layer → their outputs [N, d] (keys and values written at their positions)."""
    layer = model.layer
    residual, attn_in = _inputs(layer, model.embed_tokens(next_tokens), hidden)
    table = model.rotary()
    cache.fit(int(positions.max()) + 1)
    return fused_decoder.run_layer(layer, residual, table.cos[positions], table.sin[positions], cache.k[0],
                                   cache.v[0], slots, positions, normed=attn_in)


def fold(model: ChainDraftModel, cache: ContextCache, slot: int, taps: torch.Tensor, next_tokens: torch.Tensor,
         start: int) -> torch.Tensor:
    """Context rows of target features taps [P, T*d] at positions start.. paired with next_tokens [P] →
    the last row's output [d] (it predicts the first draft)."""
    n = len(taps)
    out = rows(model, cache, model.context(taps), next_tokens, torch.arange(start, start + n),
               torch.full((n,), slot, dtype=torch.long))
    return out[-1]


def logits(model: ChainDraftModel, out: torch.Tensor) -> torch.Tensor:
    """`ChainDraftModel.logits` with the final norm on the kernel: row outputs [R, d] → [R, Vd]."""
    return model.lm_head(fused_decoder.rms_norm(model.norm, out))


def _inputs(layer: ChainLayer, emb: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`ChainLayer.inputs` with its norms on the kernel → (residual [N, d], attention input [N, d_in])."""
    normed = fused_decoder.rms_norm(layer.hidden_norm, hidden)
    if layer.mtp:
        x = layer.proj(torch.cat([normed, fused_decoder.rms_norm(layer.embed_norm, emb)], dim=-1))
        return x, fused_decoder.rms_norm(layer.input_layernorm, x)
    attn_in = torch.cat([fused_decoder.rms_norm(layer.embed_norm, emb), normed], dim=-1)
    return normed if layer.norm_before_residual else hidden, attn_in

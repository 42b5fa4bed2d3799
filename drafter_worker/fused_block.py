"""Block drafters (DFlash, DSpark) on the CPU serving kernels: a block's backbone is one kernel call per layer,
the γ greedy steps of DSpark's Markov head one more.

On the module path a block of γ costs a few hundred aten calls (padding every request's context, the mask,
per layer a dozen projections and reshapes, SDPA), more than the target's whole fused step. Here the block's
rows are decoder rows of services/kernels/decoder.cpp over the drafter's `ContextCache`: each row writes its
key at its own position (anchor + k) and sees keys 0..anchor + γ' − 1, that is the context strictly before
the anchor (its injected target features) and every row of its block (bidirectional), which is the
attention `BlockDraftModel.backbone` computes. A row is computed alone, so a request's drafts do not depend
on what else shares the batch. Bits differ from the module path's (as the target's fused step does): drafts
are proposals, verification alone decides what is emitted, so losslessness does not rest on them.

`DSPARK_FUSED_DECODER=0` keeps the module path, as it does for the target.
"""

from __future__ import annotations

import torch

from drafter_worker.block_model import BlockDraftModel
from drafter_worker.config import HeadType
from drafter_worker.context_cache import ContextCache
from drafter_worker.layers import BlockLayer, DraftAttention
from services import cpu_kernels, fused_decoder
from services.packed_linear import kernel_weight


def serves(model) -> bool:
    """Whether `model`'s blocks run on the kernel here: a block model on the CPU whose layers the kernel
    computes (after `prepare`), in a dtype the CPU's kernel serves."""
    if not isinstance(model, BlockDraftModel) or not fused_decoder.kernel_serves(model.config, model.lm_head.weight):
        return False
    return all(fused_decoder.plain(layer, model.config, (BlockLayer, DraftAttention)) for layer in model.layers)


def prepare(model: BlockDraftModel) -> None:
    """Fuse each layer's q/k/v and gate/up weights (checkpoint names unchanged), before they are packed."""
    for layer in model.layers:
        layer.self_attn.fuse()
        layer.mlp.fuse()


def fold(model: BlockDraftModel, cache: ContextCache, slot: int, taps: torch.Tensor, start: int) -> None:
    """`BlockDraftModel.context_kv` into the cache on the kernel: target features taps [P, T*d] of positions
    start..start+P−1 → every layer's context keys and values in `slot` (one kernel call per layer)."""
    ctx = model.context(taps).contiguous()  # [P, d]
    cache.fit(start + len(ctx))
    positions = torch.arange(start, start + len(ctx))
    table = model.rotary()
    cos, sin = table.cos[positions], table.sin[positions]  # [P, Dh] fp32
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        cpu_kernels.context_rows(ctx, kernel_weight(attn.kv_weight, attn.kv_packed), attn.kv_bias, cos, sin,
                                 cache.k[i], cache.v[i], slot, start)


def backbone(
    model: BlockDraftModel,
    cache: ContextCache,
    anchors: torch.Tensor,  # [A] int64 anchor tokens
    anchor_pos: torch.Tensor,  # [A] int64 anchor positions (each request's context holds 0..anchor − 1)
    slots: torch.Tensor,  # [A] int64 each block's slot in `cache`
    gamma: int,
) -> torch.Tensor:
    """→ h [A, γ, d], what `BlockDraftModel.backbone` returns for the same context."""
    width = gamma + (model.dconfig.layout == "fill_in")
    cache.fit(int(anchor_pos.max()) + width)
    slot_tokens = torch.full((len(anchors), width), model.dconfig.mask_token_id, dtype=torch.long)
    slot_tokens[:, 0] = anchors  # [A, γ'] anchor, MASK, …
    positions = (anchor_pos[:, None] + torch.arange(width)).flatten()  # [A·γ'] row k of a block at anchor + k
    visible = (anchor_pos + width - 1).repeat_interleave(width)  # [A·γ'] every row sees its whole block
    row_slots = slots.repeat_interleave(width)  # [A·γ']
    table = model.rotary()
    cos, sin = table.cos[positions], table.sin[positions]  # [A·γ', Dh] fp32
    x = model.embed_tokens(slot_tokens.flatten())  # [A·γ', d]
    for i, layer in enumerate(model.layers):
        x = fused_decoder.run_layer(layer, x, cos, sin, cache.k[i], cache.v[i], row_slots, positions, visible)
    rows = x.view(len(anchors), width, -1)
    return fused_decoder.rms_norm(model.norm, rows[:, 1:] if width > gamma else rows)  # `BlockDraftModel.final`


def markov(model) -> bool:
    """Whether the model's sequential head runs on the one-call kernel (a Markov head; gated and rnn do not)."""
    return model.seq_head is not None and model.seq_head.kind is HeadType.MARKOV


def greedy_heads(model: BlockDraftModel, h: torch.Tensor, anchors: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`BlockDraftModel.greedy_heads` with a Markov head's γ steps in one kernel call (services/kernels/heads.cpp):
    h [A, γ, d], anchors [A] → tokens [A, γ], peaks [A, γ], confidence logits [A, γ] or None. Other heads (gated,
    rnn) and none (DFlash, already one vectorised step) keep the module path."""
    if not markov(model):
        return model.greedy_heads(h, anchors)
    return tuple(_markov_block(model, h, anchors, (None, None, None, None, 0)))


def sampled_heads(model: BlockDraftModel, h: torch.Tensor, anchors: torch.Tensor, temperature: torch.Tensor,
                  top_k: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor, max_q: int):
    """A Markov head's sampled block in one kernel call: every row at its temperature (> 0), top-k, top-p [A],
    drawing step k by inverting its q' at uniform [A, γ] → tokens [A, γ], peaks q'[0] [A, γ], confidence
    logits [A, γ] or None, q' ids [A, γ, K] and probs [A, γ, K] (K = max_q), what verification is sent."""
    return tuple(_markov_block(model, h, anchors, (temperature, top_k, top_p, uniform, max_q)))


def _markov_block(model: BlockDraftModel, h: torch.Tensor, anchors: torch.Tensor, sampling: tuple) -> list:
    head, conf = model.seq_head, model.confidence
    _, base, _ = model.heads_start(h)  # U [A, γ, Vd] fp32
    proj = head.markov_proj
    conf_w = None if conf is None else conf.proj.weight.flatten()  # [d + r]
    conf_b = 0.0 if conf is None or conf.proj.bias is None else float(conf.proj.bias)
    out = cpu_kernels.markov_block(base, h.contiguous(), model.draft_ids(anchors), head.markov_embed.weight,
                                   kernel_weight(proj.weight, getattr(proj, "packed", None)), conf_w, conf_b,
                                   *sampling)  # draft ids in, draft ids out
    out[0] = model.to_target(out[0])
    if len(out) > 3:
        out[3] = model.to_target(out[3])  # q' ids
    if conf is None:
        out[2] = None
    return out

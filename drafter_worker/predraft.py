"""Drafting ahead: the next block for each likely outcome of the block in verification (`speculation.py`).

A pre-drafted block for outcome (ℓ, v) is anchored at v, position p + ℓ + 1 (p the old anchor's), over a
context that verification has not extended yet: the old anchor and the ℓ accepted drafts have no target
features. They get stand-ins from the drafter itself, as EAGLE's training-time test has them:

- block models (DFlash, DSpark): the block's own states h_0..h_ℓ at positions p..p+ℓ, projected to each
  layer's context keys and values as target features are;
- chain models (EAGLE-3, MTP): the draft rows the block was drafted with (each pairs the drafter's own output
  of the row before with its draft token) are context rows already; a new row pairs the output h_ℓ with v.

All requests' outcomes are drafted in one batch, at each request's own sampling: a cached block carries the q
its tokens were drawn from, so verification stays exact.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from drafter_worker.drafter import Drafter
from drafter_worker.speculation import Outcome, likely_outcomes
from services.sampling import logits_to_probs
from services.types import DraftBlock, SamplingParams

# Per request: committed tokens, the drafts sent to verification, their survival estimates a_k, its sampling.
Sent = dict[str, tuple[list[int], list[int], list[float], SamplingParams]]


def predraft(drafter: Drafter, sent: Sent, gamma: int, budget: int, chunk: int | None = 8
             ) -> Iterator[dict[str, dict[Outcome, DraftBlock]]]:
    """Per request, a pre-drafted block for each of its `budget` likeliest outcomes, in pieces of `chunk`
    outcomes, each request's likeliest first (a generator: each step is one piece of compute, so a caller can
    stop when real drafting work arrives). None: one piece."""
    with torch.no_grad():
        rids = [rid for rid, (tokens, *_) in sent.items() if drafter.fold(rid, tokens)]
        if not rids:
            return
        owner, outcomes, draft = (_block if drafter.block else _chain)(drafter, rids, sent, gamma, budget)
    rank = [0] * len(owner)
    for i in range(1, len(owner)):
        rank[i] = rank[i - 1] + 1 if owner[i] == owner[i - 1] else 0
    order = sorted(range(len(owner)), key=lambda i: (rank[i], owner[i]))  # every request's best ones first
    size = chunk or max(1, len(order))
    for first in range(0, len(order), size):
        picked = order[first : first + size]
        with torch.no_grad():  # not around the yield: grad mode is per thread, the caller's while suspended
            blocks = _blocks(rids, [owner[i] for i in picked], [outcomes[i] for i in picked], draft(picked))
        yield blocks


def _block(drafter: Drafter, rids: list[str], sent: Sent, gamma: int, budget: int):
    model, dev = drafter.model, drafter.device
    tokens = [sent[rid][0] for rid in rids]
    width = max(len(sent[rid][1]) for rid in rids) + 1  # slots p..p+ℓs of the longest verified block
    kv, mask = drafter.padded_context(rids)  # per layer [R, Hkv, S, Dh], [R, S]
    start = torch.tensor([len(t) - 1 for t in tokens], device=dev)  # [R] anchor positions p
    h = model.backbone(torch.tensor([t[-1] for t in tokens], device=dev), start, kv, mask, width)  # [R, W, d]
    logits, _ = model.teacher_forced(h, _teacher(rids, sent, width, dev))  # [R, W, V] positions p+1..p+W
    owner, outcomes = _choose(rids, sent, model.scatter_vocab(logits), budget)
    rope = model.rotary().gather(start[:, None] + torch.arange(width, device=dev), h.dtype)  # [R, W, 1, Dh]
    ext = []  # per layer the context with the stand-ins of p..p+ℓs, [R, Hkv, S+W, Dh]
    for (k, v), layer in zip(kv, model.layers, strict=True):
        sk, sv = layer.self_attn.keys_values(h, rope)  # [R, Hkv, W, Dh]
        ext.append((torch.cat([k, sk], 2), torch.cat([v, sv], 2)))
    ext_mask = torch.cat([mask, torch.ones(len(rids), width, dtype=torch.bool, device=dev)], 1)  # [R, S+W]

    def draft(picked: list[int]):
        rows = torch.tensor([owner[i] for i in picked], device=dev)  # [n] request of each outcome
        accepted = torch.tensor([outcomes[i].accepted for i in picked], device=dev)  # [n]
        seen = torch.arange(ext_mask.shape[1], device=dev)[None] < ext_mask.shape[1] - width + accepted[:, None] + 1
        return drafter.draft_block(torch.tensor([outcomes[i].token for i in picked], device=dev),
                                   start[rows] + 1 + accepted, [(k[rows], v[rows]) for k, v in ext],
                                   ext_mask[rows] & seen, [sent[rids[owner[i]]][3] for i in picked], gamma,
                                   _steer(drafter, rids, owner, picked))

    return owner, outcomes, draft


def _chain(drafter: Drafter, rids: list[str], sent: Sent, gamma: int, budget: int):
    model, dev = drafter.model, drafter.device
    tokens = [sent[rid][0] for rid in rids]
    width = max(len(sent[rid][1]) for rid in rids) + 1
    ((ctx_k, ctx_v),), mask = drafter.padded_context(rids)  # [R, Hkv, S, Dh], [R, S]
    start = torch.tensor([len(t) - 1 for t in tokens], device=dev)  # [R]
    teacher = _teacher(rids, sent, width, dev)  # [R, W] anchor, then the drafts
    # Replay the block's draft rows: row k (at p + k − 1) pairs output h_{k−1} with draft x_k.
    hidden = [torch.stack([drafter.last_out(rid) for rid in rids])]  # h_0 [R, d] predicts x_1
    keys, values, seen = ctx_k, ctx_v, mask
    for k in range(1, width):
        residual, q, kk, vv = model.project(hidden[-1][:, None], teacher[:, k : k + 1], (start + k - 1)[:, None])
        keys, values = torch.cat([keys, kk], 2), torch.cat([values, vv], 2)
        seen = torch.cat([seen, torch.ones_like(seen[:, :1])], 1)
        hidden.append(model.finish(residual, q, keys, values, seen[:, None, None])[:, 0])  # h_k predicts x_{k+1}
    outs = torch.stack(hidden, 1)  # [R, W, d]
    owner, outcomes = _choose(rids, sent, model.scatter_vocab(model.logits(outs).float()), budget)

    def draft(picked: list[int]):
        rows = torch.tensor([owner[i] for i in picked], device=dev)
        accepted = torch.tensor([outcomes[i].accepted for i in picked], device=dev)  # [n]
        draft_rows = torch.arange(1, width, device=dev)[None] <= accepted[:, None]  # [n, W−1] rows of x_1..x_ℓ
        base_mask = torch.cat([mask[rows], draft_rows], 1)  # [n, S + W − 1]
        # The outcome's own row pairs h_ℓ with v at p + ℓ: the last context row of the block anchored at v.
        anchors = torch.tensor([outcomes[i].token for i in picked], device=dev)
        residual, q, kk, vv = model.project(outs[rows, accepted][:, None], anchors[:, None],
                                            (start[rows] + accepted)[:, None])
        k_n, v_n = torch.cat([keys[rows], kk], 2), torch.cat([values[rows], vv], 2)  # [n, Hkv, S + W, Dh]
        full_mask = torch.cat([base_mask, torch.ones_like(base_mask[:, :1])], 1)  # [n, S + W]
        last = model.finish(residual, q, k_n, v_n, full_mask[:, None, None])[:, 0]  # [n, d] predicts the next x_1
        return drafter.draft_chain(last, start[rows] + 1 + accepted, [(k_n, v_n)], full_mask,
                                   [sent[rids[owner[i]]][3] for i in picked], gamma,
                                   _steer(drafter, rids, owner, picked))

    return owner, outcomes, draft


def _steer(drafter: Drafter, rids: list[str], owner: list[int], picked: list[int]) -> list[bool]:
    """Whether each pre-drafted block's drafts are steered (they are verified like any block of the request)."""
    return [rids[owner[i]] in drafter.steered for i in picked]


def _teacher(rids: list[str], sent: Sent, width: int, dev: torch.device) -> torch.Tensor:
    """[R, W] each request's anchor, then its verified drafts, padded with 0 (read only behind a mask)."""
    rows = [[sent[rid][0][-1], *sent[rid][1]] for rid in rids]
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], device=dev)


def _choose(rids: list[str], sent: Sent, logits: torch.Tensor, budget: int) -> tuple[list[int], list[Outcome]]:
    """logits [R, W, V] of positions p+1..p+W → (request index, outcome) of every outcome to pre-draft."""
    owner, outcomes = [], []
    for r, rid in enumerate(rids):
        _, drafts, survival, params = sent[rid]
        found = likely_outcomes(drafts, survival, _outcome_probs(logits[r, : len(drafts) + 1], params), budget)
        owner.extend([r] * len(found))
        outcomes.extend(found)
    return owner, outcomes


def _outcome_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, V] the distributions the outcome is guessed from: the request's own (T = 1 for greedy, whose
    one-hot would rank nothing but the argmax)."""
    if params.greedy:
        return logits.softmax(-1)
    n = logits.shape[0]
    return logits_to_probs(logits, torch.full((n,), params.temperature), torch.full((n,), params.top_k),
                           torch.full((n,), params.top_p))


def _blocks(rids, owner, outcomes, drafted) -> dict[str, dict[Outcome, DraftBlock]]:
    if not outcomes:
        return {}
    new, q, conf, peaks = drafted
    out: dict[str, dict[Outcome, DraftBlock]] = {rid: {} for rid in rids}
    for i, (r, o) in enumerate(zip(owner, outcomes, strict=True)):
        out[rids[r]][o] = DraftBlock(tokens=new[i], q_ids=None if q[i] is None else q[i][0],
                                     q_probs=None if q[i] is None else q[i][1],
                                     confidences=None if conf is None else conf[i].tolist(),
                                     peaks=peaks[i].tolist(), ahead=True)
    return out

"""A frequency-ranked draft vocabulary for dspark's own chain drafters, as EAGLE-3 builds one.

The Vd most frequent target tokens of a corpus, sorted, become the draft vocabulary: d2t[i] = hot[i] − i
(SpecForge's rule), and the drafter's LM head keeps only their rows of the target's head. The drafter then
scores Vd tokens per step instead of V, and its q is 0 outside them; verification stays exact
(`drafter_worker/base.py: vocab_logits`). What it costs in τ and buys in draft time:
`benchmarks/draft_vocab.py`.
"""

from __future__ import annotations

import dataclasses

import torch

from drafter_worker.chain_model import ChainDraftModel
from drafter_worker.config import Method


def frequency_d2t(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """counts [V] of each target token → d2t [Vd] int64 of the Vd most frequent, in id order."""
    if not 0 < draft_vocab_size <= len(counts):
        raise ValueError(f"draft vocabulary of {draft_vocab_size} out of 1..{len(counts)}")
    hot = counts.double().topk(draft_vocab_size).indices.sort().values
    return hot - torch.arange(draft_vocab_size)


def reduce_vocab(model: ChainDraftModel, d2t: torch.Tensor) -> ChainDraftModel:
    """A copy of a full-vocabulary EAGLE-3 drafter that drafts over the tokens d2t names (its head: their rows)."""
    if model.dconfig.method is not Method.EAGLE3 or model.reduced_vocab:
        raise ValueError("reduce_vocab takes an eagle3 drafter over the full vocabulary")
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    reduced = ChainDraftModel(dataclasses.replace(model.dconfig, draft_vocab_size=len(d2t)), model.config)
    reduced = reduced.to(device=device, dtype=dtype)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    hot = (torch.arange(len(d2t)) + d2t).to(device)  # target ids, increasing
    state |= {"lm_head.weight": model.lm_head.weight.detach()[hot], "d2t": d2t.to(device)}
    reduced.load_state_dict(state)
    return reduced.eval()


def rollout_counts(rows: list[dict], vocab_size: int) -> torch.Tensor:
    """counts [V] of every response token of the target's rollouts (what the drafter will have to draft)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in rows:
        counts += torch.bincount(torch.tensor(row["response_ids"], dtype=torch.long), minlength=vocab_size)
    return counts


def coverage(d2t: torch.Tensor, rows: list[dict], vocab_size: int) -> dict[str, float]:
    """Per domain (and `all`): the share of response tokens inside the draft vocabulary — the tokens a drafter
    over it can ever propose; the others are never drafted (their cycle emits the target's own token)."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[torch.arange(len(d2t)) + d2t] = True
    hits: dict[str, list[int]] = {}
    for row in rows:
        ids = torch.tensor(row["response_ids"], dtype=torch.long)
        for key in (row["domain"], "all"):
            h = hits.setdefault(key, [0, 0])
            h[0] += int(inside[ids].sum())
            h[1] += len(ids)
    return {key: round(h[0] / max(h[1], 1), 4) for key, h in sorted(hits.items())}

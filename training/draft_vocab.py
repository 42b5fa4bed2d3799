"""A frequency-ranked draft vocabulary for dspark's drafters, as EAGLE-3 builds one.

The Vd most frequent target tokens of a corpus, sorted, become the draft vocabulary: d2t[i] = hot[i] − i
(SpecForge's rule), and the drafter's LM head keeps only their rows of the target's head. The drafter then
scores Vd tokens per step instead of V, and its q is 0 outside them; verification stays exact
(`drafter_worker/base.py`). What it costs in τ and buys in draft time:
`benchmarks/draft_vocab.py`.
"""

from __future__ import annotations

import dataclasses

import torch

from drafter_worker.checkpoint import DraftModel


def frequency_d2t(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """counts [V] of each target token → d2t [Vd] int64 of the Vd most frequent, in id order."""
    if not 0 < draft_vocab_size <= len(counts):
        raise ValueError(f"draft vocabulary of {draft_vocab_size} out of 1..{len(counts)}")
    hot = counts.double().topk(draft_vocab_size).indices.sort().values
    return hot - torch.arange(draft_vocab_size)


def reduce_vocab(model: DraftModel, d2t: torch.Tensor) -> DraftModel:
    """A copy of a full-vocabulary drafter that drafts over the tokens d2t names: its head the same rows of the
    target's (shared), a Markov head's W1 / W2 their rows (W1 a zero row for a token outside)."""
    if model.reduced_vocab:
        raise ValueError("reduce_vocab takes a drafter over the full vocabulary")
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    cls = type(model)
    reduced = cls(dataclasses.replace(model.dconfig, draft_vocab_size=len(d2t)), model.config,
                  model.embed_tokens.weight)
    reduced = reduced.to(device=device, dtype=dtype)
    hot = (torch.arange(len(d2t)) + d2t).to(device)  # target ids, increasing
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    if "seq_head.markov_embed.weight" in state:
        w1 = state["seq_head.markov_embed.weight"]
        state["seq_head.markov_embed.weight"] = torch.cat([w1[hot], w1.new_zeros(1, w1.shape[1])])
        state["seq_head.markov_proj.weight"] = state["seq_head.markov_proj.weight"][hot]
    reduced.load_state_dict(state | {"d2t": d2t.to(device)}, strict=False)
    reduced.index_vocab()
    reduced.share_head(model.lm_head.weight)
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

"""Logits processors of the OpenAI / vLLM sampling fields, applied inside verification, row by row.

A verify item [anchor, x1..xℓ] yields ℓ+1 logits rows; row k is what plain decoding would have computed after
the committed tokens and x1..xk. Each processor therefore reads that row's own context — the prompt, the
output so far and the drafts before row k — and never x_{k+1}, the token the row decides about. Speculative
output under any processor is then exactly plain decoding with it (greedy: the argmax of the processed row;
sampled: the rejection test against the processed target distribution).

Order (vLLM's sampler): allowed_token_ids, bad_words, min_tokens and logit_bias, then the repetition (prompt +
output, Hugging Face's rule: divide a positive logit, multiply a negative one), frequency and presence (output
only) penalties. A bad word's last token is banned in a row whose output (the drafts before it included) ends
with the rest of the word: the row's own context, as everywhere here.
Temperature and min_p follow in `services.sampling.logits_to_probs`; min_p never moves the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.types import SamplingParams


@dataclass(slots=True)
class RowContext:
    """What one logits row's processors read."""

    params: SamplingParams
    prompt: Sequence[int]  # the request's prompt
    output: Sequence[int]  # output tokens before this row: committed output, then the drafts before it


def active(p: SamplingParams) -> bool:
    """Whether any processor of `p` changes logits (min_p is applied with the sampling filters)."""
    return bool(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty or p.logit_bias
                or p.min_tokens > 0 or p.allowed_token_ids or p.bad_words)


def apply(logits: torch.Tensor, rows: Sequence[RowContext | None]) -> torch.Tensor:
    """logits [M, V] → fp32 [M, V] with each row's processors applied; rows[r] None leaves row r as it is."""
    index = [r for r, ctx in enumerate(rows) if ctx is not None and active(ctx.params)]
    if not index:
        return logits
    ctxs = [rows[r] for r in index]
    out = logits.float().clone()
    sub = out[index]  # [R, V]
    vocab, dev = sub.shape[-1], sub.device
    sub = _min_tokens(_logit_bias(_bad_words(_allowed(sub, ctxs), ctxs), ctxs), ctxs)
    counts = _counts([c.output for c in ctxs], vocab, dev)  # [R, V] occurrences in the output
    rep = torch.tensor([c.params.repetition_penalty for c in ctxs], device=dev)[:, None]  # [R, 1]
    if bool((rep != 1.0).any()):
        seen = (counts + _counts([c.prompt for c in ctxs], vocab, dev)) > 0  # [R, V]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([c.params.frequency_penalty for c in ctxs], device=dev)[:, None]  # [R, 1]
    pres = torch.tensor([c.params.presence_penalty for c in ctxs], device=dev)[:, None]  # [R, 1]
    sub = sub - freq * counts - pres * (counts > 0).float()
    out[index] = sub
    return out


def _counts(token_lists: Sequence[Sequence[int]], vocab: int, dev: torch.device) -> torch.Tensor:
    """[R, V] fp32: how often each token occurs in each list."""
    counts = torch.zeros(len(token_lists), vocab, device=dev)
    for r, tokens in enumerate(token_lists):
        if tokens:
            counts[r].index_add_(0, torch.as_tensor(list(tokens), dtype=torch.long, device=dev),
                                 torch.ones(len(tokens), device=dev))
    return counts


def _logit_bias(sub: torch.Tensor, ctxs: Sequence[RowContext]) -> torch.Tensor:
    for r, ctx in enumerate(ctxs):
        if ctx.params.logit_bias:
            ids, bias = zip(*ctx.params.logit_bias, strict=True)
            sub[r].index_add_(0, torch.tensor(ids, dtype=torch.long, device=sub.device),
                              torch.tensor(bias, dtype=sub.dtype, device=sub.device))
    return sub


def _allowed(sub: torch.Tensor, ctxs: Sequence[RowContext]) -> torch.Tensor:
    for r, ctx in enumerate(ctxs):
        if ctx.params.allowed_token_ids:
            keep = torch.zeros(sub.shape[-1], dtype=torch.bool, device=sub.device)
            keep[list(ctx.params.allowed_token_ids)] = True
            sub[r].masked_fill_(~keep, float("-inf"))
    return sub


def _bad_words(sub: torch.Tensor, ctxs: Sequence[RowContext]) -> torch.Tensor:
    for r, ctx in enumerate(ctxs):
        for word in ctx.params.bad_words:
            *head, last = word
            if not head or (len(ctx.output) >= len(head) and list(ctx.output[len(ctx.output) - len(head):]) == head):
                sub[r, last] = float("-inf")
    return sub


def _min_tokens(sub: torch.Tensor, ctxs: Sequence[RowContext]) -> torch.Tensor:
    for r, ctx in enumerate(ctxs):
        p = ctx.params
        if len(ctx.output) < p.min_tokens and p.stop_token_ids:
            sub[r, list(p.stop_token_ids)] = float("-inf")
    return sub

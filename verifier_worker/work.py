"""The engine's per-request state and one step's work items, and which logits rows each item reads.

A step's forward returns logits only for the rows that need them (`logit_positions`): every row of a verify
item (p_1..p_{ℓ+1}), the last row of a prompt's last prefill chunk (the first token), and every prompt row
when the request asks for prompt logprobs. Each of those rows gets the processors' context it would have in
plain decoding (`row_contexts`), and its log-softmax when logprobs are asked for (`item_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services import processors
from services.processors import RowContext
from services.sampling import token_logprobs
from services.types import DraftBlock, SamplingParams, StepOutput

if TYPE_CHECKING:  # structured output's llguidance is imported at the first request that asks for it
    from services.grammar import RequestGrammar


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    params: SamplingParams
    tokens: list[int]  # committed: prompt, then emitted tokens (the last is the anchor)
    prompt_len: int  # positions to prefill: the prompt, or prompt + resumed tokens but the anchor
    num_prompt: int  # the request's own prompt (what processors count as prompt, the rest is output)
    generator: torch.Generator | None
    prefilled: int = 0  # prompt positions in the cache
    resumed: bool = False  # re-prefilled from committed tokens: the anchor is given, nothing is sampled
    pending: DraftBlock | None = None  # the cycle submitted for the next step (may be empty)
    share_from: str = ""  # a running request with the same prompt whose cached prefix may be copied
    grammar: RequestGrammar | None = None  # structured output: the grammar state over the committed output

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < self.prompt_len

    @property
    def prompt(self) -> list[int]:
        return self.tokens[: self.num_prompt]

    @property
    def output(self) -> list[int]:
        return self.tokens[self.num_prompt :]


@dataclass(slots=True)
class WorkItem:
    """One request's share of a step."""

    request: EngineRequest
    new_tokens: list[int]
    start: int  # cache position of new_tokens[0]
    draft: DraftBlock | None  # None for a prefill chunk
    logit_offset: int = -1  # first logits row of this item, -1 when it needs none


def samples_first(it: WorkItem) -> bool:
    """A prefill chunk whose last row gives the request's first token (the prompt's last chunk)."""
    req = it.request
    return it.draft is None and it.start + len(it.new_tokens) == req.prompt_len and not req.resumed


def logit_positions(it: WorkItem) -> range:
    n = len(it.new_tokens)
    if it.draft is not None:
        return range(n)  # p_1..p_{ℓ+1}
    if it.request.params.prompt_logprobs is not None and not it.request.resumed:
        return range(n)  # every prompt row predicts the next prompt token (the last: the first output)
    return range(n - 1, n) if samples_first(it) else range(0)


def first_token_row(it: WorkItem) -> int:
    """The logits row that samples a prefill's first token (the chunk's last row)."""
    return it.logit_offset + len(logit_positions(it)) - 1


def row_contexts(items: list[WorkItem]) -> list[RowContext | None]:
    """Per logits row, what its processors read (None: a row that samples nothing, or no processors)."""
    rows: list[RowContext | None] = []
    for it in items:
        req, count = it.request, len(logit_positions(it))
        if not count or not processors.active(req.params):
            rows += [None] * count
        elif it.draft is None:  # only the row giving the first token samples
            rows += [None] * (count - 1) + [RowContext(req.params, req.prompt, [])]
        else:
            output = req.output
            rows += [RowContext(req.params, req.prompt, output + it.draft.tokens[:k]) for k in range(count)]
    return rows


def grammar_masks(items: list[WorkItem], logits: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """Structured output (services/grammar.py): each constrained row −inf outside what its grammar allows after
    that row's own output (the drafts before it included), as processors read their rows. `raw` is left as it is
    (the logprobs are of the raw distribution)."""
    rows, masks = [], []
    for it in items:
        grammar = it.request.grammar
        if grammar is None or it.logit_offset < 0:
            continue
        if it.draft is not None:
            rows.extend(range(it.logit_offset, it.logit_offset + len(it.draft) + 1))
            masks.append(grammar.masks(it.draft.tokens))  # [ℓ + 1, V]
        elif samples_first(it):
            rows.append(first_token_row(it))
            masks.append(grammar.masks([]))
    if not rows:
        return logits
    # In place (a gather and scatter of float rows cost more than the masks on a 262,144-token vocabulary); on a
    # copy only when the raw rows are still to be read for logprobs.
    keep_raw = logits is raw and any(it.request.params.logprobs is not None
                                     or it.request.params.prompt_logprobs is not None for it in items)
    out = logits.float().clone() if keep_raw else logits.float()
    blocked = torch.zeros(out.shape, dtype=torch.bool, device=out.device)  # [M, V]
    blocked[torch.tensor(rows, device=out.device)] = ~torch.cat(masks).to(out.device)  # [R, V] rows
    return out.masked_fill_(blocked, float("-inf"))


def add_logprobs(it: WorkItem, out: StepOutput, raw: torch.Tensor) -> None:
    """Row j of a verify item predicted emitted[j]; a prefill row at position p predicted token p + 1."""
    params, req = it.request.params, it.request
    if params.logprobs is not None and out.emitted:
        first = first_token_row(it) if it.draft is None else it.logit_offset
        rows = list(range(first, first + len(out.emitted)))
        out.logprobs = token_logprobs(raw, rows, out.emitted, params.logprobs)
    if it.draft is None and params.prompt_logprobs is not None and it.logit_offset >= 0:
        count = min(len(it.new_tokens), req.num_prompt - 1 - it.start)  # rows whose next token is prompt
        rows = list(range(it.logit_offset, it.logit_offset + count))
        targets = req.tokens[it.start + 1 : it.start + 1 + count]
        out.prompt_logprobs = token_logprobs(raw, rows, targets, params.prompt_logprobs)

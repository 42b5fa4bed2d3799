"""Constrained drafting: a request with a grammar (structured output) drafts only what its grammar allows.

The verifier masks each verified row by the grammar state after the committed output and the drafts before the
row (services/grammar.py), so a draft the grammar forbids is always rejected: drafting it wastes the rest of the
block. A drafter that holds the same grammar state masks its own logits the same way — step k of a block to
what the grammar allows after the committed output and drafts 1..k−1 — and never proposes such a draft. The
drafts are then sampled from the masked q, which is the q the block carries, so the verifier's rejection rule
stays exact for any temperature (it holds for every q); greedy drafts are the argmax of the masked logits.

A block ends early where the grammar allows no id of the draft vocabulary (e.g. only tokens outside it): the
verifier's own token follows. The grammar state is advanced tentatively through the block and rolled back after
it; the committed output advances it for good (`Constraint.catch_up`). A grammar the drafter cannot follow (a
committed token it refuses: the verifier and the drafter disagree on the vocabulary) drops the constraint — the
request drafts unconstrained, which is still lossless.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.grammar import RequestGrammar

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Constraint:
    """A request's grammar in the drafter, and how much of its committed tokens the grammar has read."""

    grammar: RequestGrammar
    read: int  # committed tokens already consumed (the prompt counts as read: the grammar starts at the output)

    def catch_up(self, tokens: list[int]) -> bool:
        """Consume the committed tokens after `read`; False when the grammar refuses one (drop the constraint)."""
        try:
            self.grammar.commit(tokens[self.read:])
        except RuntimeError as error:
            log.warning("constrained drafting dropped: %s", error)
            return False
        self.read = len(tokens)
        return True


class GrammarWalk:
    """One block's walk of a batch's grammars (None: an unconstrained row): `mask` step k's logits, `advance` by
    the drafts drawn from them, `finish` to roll back and learn where each constrained row's block ends."""

    def __init__(self, grammars: list[RequestGrammar | None], target_ids: torch.Tensor):
        self.grammars, self.target_ids = grammars, target_ids  # target_ids [Vd]: the target id of each draft id
        self.consumed = [0] * len(grammars)
        self.length: list[int | None] = [None] * len(grammars)  # where a row's block ends (None: γ)

    def mask(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        """logits [R, Vd] of step k → −inf where a constrained row's grammar forbids the token (in place)."""
        for i, grammar in enumerate(self.grammars):
            if grammar is None or self.length[i] is not None:
                continue
            allowed = grammar.allowed().to(logits.device)[self.target_ids]  # [Vd] bool
            if not bool(allowed.any()):
                self.length[i] = k  # nothing here may be drafted: the block ends before step k
                continue
            logits[i].masked_fill_(~allowed, float("-inf"))
        return logits

    def advance(self, tokens: torch.Tensor, k: int) -> None:
        """tokens [R] (target ids) drawn at step k from the masked logits."""
        for i, grammar in enumerate(self.grammars):
            if grammar is None or self.length[i] is not None:
                continue
            token = int(tokens[i])
            if token in grammar.eos:  # the grammar is complete and the request ends with this draft
                self.length[i] = k + 1
            elif grammar.advance(token):
                self.consumed[i] += 1
            else:  # cannot happen for a token drawn from the mask; end the block rather than send it
                self.length[i] = k

    def finish(self) -> list[int | None]:
        """Roll every grammar back to the committed output → each row's block length (None: uncut)."""
        for grammar, consumed in zip(self.grammars, self.consumed, strict=True):
            if grammar is not None:
                grammar.rollback(consumed)
        return self.length


def cut(tokens: list[list[int]], q: list, conf: torch.Tensor | None, peaks: torch.Tensor,
        lengths: list[int | None]) -> tuple[list[list[int]], list, list[torch.Tensor] | None, list[torch.Tensor]]:
    """Blocks cut to `lengths` → per row tokens [n], q ([n, K] ids, probs, or None), confidences [n] (or None),
    peaks [n]."""
    ends = [len(t) if n is None else n for t, n in zip(tokens, lengths, strict=True)]
    return ([t[:n] for t, n in zip(tokens, ends, strict=True)],
            [None if qi is None else (qi[0][:n], qi[1][:n]) for qi, n in zip(q, ends, strict=True)],
            None if conf is None else [conf[i][:n] for i, n in enumerate(ends)],
            [peaks[i][:n] for i, n in enumerate(ends)])

"""`RunAhead`: a `Drafter` that drafts the next block while the current one is verified.

The router calls `speculate` once a block is cut to its verify length and sent; the drafter pre-drafts the
next block for the likeliest outcomes (`predraft.py`, cached in `PredraftCache`). The next `propose`
answers a request from the cache when its committed tokens show a cached outcome (a hit, `DraftBlock.ahead`)
and drafts the others as before. In process the two run in turn (the hit rate and the acceptance of cached
blocks are measured that way); across the tiers the drafter runs `speculate` while the verifier works.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from drafter_worker.drafter import Drafter
from drafter_worker.predraft import predraft
from drafter_worker.speculation import Outcome, PredraftCache, Predrafted, Steering
from services.types import DraftBlock, SamplingParams


class RunAhead:
    def __init__(self, drafter: Drafter, budget: int, steering: Steering | None = None):
        """`budget`: blocks pre-drafted per request and cycle (served: `DrafterSettings.ahead_budget`);
        `steering`: Saguaro sampling of the drafts of requests that draft ahead (served: `steer_top`,
        `steer_factor`)."""
        if budget < 1:
            raise ValueError(f"the speculation budget must be at least 1, got {budget}")
        self.drafter, self.budget = drafter, budget
        drafter.steering = steering
        self.cache = PredraftCache()
        self._missed: dict[str, int] = {}  # request → fan-out of its missed speculation, for its fresh block

    @property
    def model(self):
        """The draft model (what a drafter service reads its limits from)."""
        return self.drafter.model

    def commit(self, request_id: str, feature_start: int, features: torch.Tensor | None) -> None:
        self.drafter.commit(request_id, feature_start, features)

    def constrain(self, request_id: str, grammar, output_start: int) -> None:
        """A request with a grammar drafts under it (`Drafter.constrain`) and never ahead: a block drafted ahead
        would not be."""
        self.drafter.constrain(request_id, grammar, output_start)

    def release(self, request_id: str) -> None:
        self.drafter.release(request_id)
        self.drafter.steered.discard(request_id)
        self.cache.drop(request_id)
        self._missed.pop(request_id, None)

    def cached(self, request_id: str, tokens: list[int], gamma: int) -> DraftBlock | None:
        """The block drafted ahead for the outcome `tokens` show (a hit), else None; either way the request's
        speculation ends. No compute: the new features fold into the context at the next draft or speculation.
        The block (this one, or on a miss the one drafted afresh) carries the speculation's fan-out."""
        fanout = self.cache.fanout(request_id)
        block = self.cache.take(request_id, tokens) if gamma > 0 else None
        if block is None:
            if fanout:
                self._missed[request_id] = fanout
            return None
        block = block.head(gamma)
        block.fanout = fanout
        return block

    def propose(self, contexts: dict[str, list[int]], gamma: int,
                params: dict[str, SamplingParams] | None = None) -> dict[str, DraftBlock]:
        hits = {}
        for rid, tokens in contexts.items():
            block = self.cached(rid, tokens, gamma)
            if block is not None:
                self.drafter.fold(rid, tokens)  # the verified features still join the context
                hits[rid] = block
        fresh = self.drafter.propose({rid: t for rid, t in contexts.items() if rid not in hits}, gamma, params)
        for rid, block in fresh.items():
            block.fanout = self._missed.pop(rid, 0)
        return {**fresh, **hits}

    def speculate(self, sent: dict[str, tuple[list[int], DraftBlock]], gamma: int,
                  params: dict[str, SamplingParams] | None = None) -> None:
        """`sent`: per request its committed tokens and the block sent to verification (cut to ℓ_s)."""
        for _ in self.speculation(sent, gamma, params, chunk=None):
            pass

    def speculation(self, sent: dict[str, tuple[list[int], DraftBlock]], gamma: int,
                    params: dict[str, SamplingParams] | None = None, chunk: int | None = 2
                    ) -> Iterator[dict[str, dict[Outcome, DraftBlock]]]:
        """`speculate` in pieces of `chunk` pre-drafted blocks per request, each request's likeliest outcomes
        first; every piece is cached as it is done (and yielded: the first one is pushed to the router), so a
        caller that stops iterating (real drafting work came in) keeps what was drafted so far. A piece spans
        every request (one batched drafter call): pieces of a fixed size left all but the first few of a large
        batch without a single block in the window."""
        params = params or {}
        work = {}
        for rid, (tokens, block) in sent.items():
            if rid in self.drafter.constrained:
                continue
            survival = block.confidences if block.confidences is not None else block.peaks
            if survival is not None:  # else nothing to estimate the outcome from
                work[rid] = (tokens, list(block.tokens), survival, params.get(rid, SamplingParams()))
                self.cache.store(rid, Predrafted(len(tokens), list(block.tokens), {}))
                self.drafter.steered.add(rid)  # it drafts ahead: its drafts from now on are steered
        for piece in predraft(self.drafter, work, gamma, self.budget, chunk and chunk * len(work)):
            for rid, blocks in piece.items():
                self.cache.add(rid, blocks)
            yield piece

"""The drafter tier's async core: draft sessions of many requests, batched proposes (no gRPC, no Ray).

A replica hosts one or more proposers (one per method). `open` binds a request to a method and loads
its committed tokens and features; each `draft` applies the delta since the last message (new tokens,
new features) and queues the request; one loop task drafts every queued request of a method in one
batched `propose`, in a worker thread, under `_lock` (which also guards every context change).

Cycles: `draft` must carry a cycle greater than the last one applied (the router may verify cycles
without drafting, e.g. while the drafter was unreachable); anything else is stale and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from drafter_worker.ahead_window import AheadWindow
from drafter_worker.proposer import DraftLimits, model_limits
from services.calls import AheadCall, DraftCall, OpenCall, Pushed
from services.errors import InvalidRequestError, StaleCycleError
from services.lease import Lease
from services.tier_loop import TierLoop
from services.types import DraftBlock, DrafterLoad, Proposer, SamplingParams

if TYPE_CHECKING:  # loaded when a request first drafts under a grammar
    from services.grammar import GrammarTokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _DraftSession:
    method: str
    tokens: list[int]  # committed tokens; the last is the anchor
    params: SamplingParams
    cycle: int
    features: int  # positions with features: always len(tokens) − 1 between messages
    lease: Lease = field(default_factory=Lease)  # Draft streams attached; freed once none has for lease_s
    last: tuple[DraftBlock, int] | None = None  # the block answered this cycle and its γ (to draft ahead of)
    notice_at: float | None = None  # monotonic time of the ahead notice the next draft request follows
    gamma: int = 0  # γ of the blocks drafted ahead at the last notice (a pushed block taken is cut to it)


@dataclass(slots=True)
class _AheadJob:
    """An ahead notice waiting for its first piece of drafting ahead: what `ahead` answers with."""

    request_id: str
    block: DraftBlock  # as sent to verification
    gamma: int
    pushed: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def push(self, blocks: list[Pushed]) -> None:
        if not self.pushed.done():
            self.pushed.set_result(blocks)


@dataclass(slots=True)
class _Queued:
    request_id: str
    gamma: int
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class DrafterService(TierLoop):
    role = "drafter"

    def __init__(self, proposers: dict[str, Proposer], block_sizes: dict[str, int], batch_window_s: float = 0.005,
                 limits: DraftLimits | None = None, lease_s: float = 60.0, fallback_queue: int = 0,
                 grammar_dir: Path | None = None, grammar: GrammarTokenizer | None = None):
        """`grammar_dir`: the target's model directory (its tokenizer.json): requests with a grammar draft under
        it (drafter_worker/constrained.py); `grammar`: the same vocabulary already loaded (in process, the
        engine's); neither: they draft unconstrained."""
        if not proposers:
            raise ValueError("a drafter replica needs at least one proposer")
        super().__init__(lease_s, batch_window_s)
        self.proposers, self.block_sizes = proposers, block_sizes
        self.limits = limits or model_limits(proposers)
        self.default_method = next(iter(proposers))
        self._sessions: dict[str, _DraftSession] = {}
        self._queue: list[_Queued] = []
        self._ahead: list[_AheadJob] = []
        self.window = AheadWindow()  # the budget of drafting ahead, sized to the verify window
        self.fallback_queue = fallback_queue  # > 0: a cache miss with this many drafts waiting gets no drafts
        self.fallbacks = 0
        self.grammar_dir, self._grammar = grammar_dir, grammar

    def _on_stop(self, reason: BaseException) -> None:
        for item in self._queue:
            if not item.done.done():
                item.done.set_exception(reason)
        for job in self._ahead:
            job.push([])

    # ---- session calls ------------------------------------------------------------------------
    async def open(self, call: OpenCall) -> int:
        """(Re)open a request's context → positions with features. Replaces any earlier context."""
        request_id, context_ids, features, params, cycle = (call.request_id, call.context_ids, call.features,
                                                            call.params, call.cycle)
        self._check_open()
        method = call.method or self.default_method
        if method not in self.proposers:
            raise InvalidRequestError(f"method {method!r} not hosted here (hosted: {', '.join(self.proposers)})")
        if not context_ids:
            raise InvalidRequestError("context is empty")
        self._check_length(len(context_ids))
        rows = 0 if features is None else len(features)
        if rows != len(context_ids) - 1 and not self._featureless(rows):
            raise InvalidRequestError(f"{len(context_ids)} context tokens need {len(context_ids) - 1} feature rows, "
                                      f"got {rows}")
        async with self._lock:
            self._forget(request_id)
            proposer = self.proposers[method]
            proposer.commit(request_id, 0, features)
            self._constrain(proposer, call)
            self._sessions[request_id] = _DraftSession(method, list(context_ids), params, cycle, rows)
        return rows

    def _constrain(self, proposer: Proposer, call: OpenCall) -> None:
        """Hand the request's grammar to a proposer that drafts under one, when the call says where the output
        starts; a grammar it cannot follow leaves the drafts unconstrained (still lossless: the verifier masks)."""
        constrain = getattr(proposer, "constrain", None)
        if (call.params.grammar is None or constrain is None or not call.output_start
                or (self.grammar_dir is None and self._grammar is None)):
            return
        try:
            if self._grammar is None:
                from services.grammar import GrammarTokenizer

                self._grammar = GrammarTokenizer(self.grammar_dir, self.limits.vocab_size)
            constrain(call.request_id, self._grammar.start(call.params.grammar), call.output_start)
        except InvalidRequestError as error:
            log.warning("request %s drafts unconstrained: %s", call.request_id, error)

    async def draft(self, call: DraftCall) -> DraftBlock:
        self._check_open()
        async with self._lock:
            session = self._sessions.get(call.request_id)
            if session is None:
                raise StaleCycleError(f"request {call.request_id!r} has no draft context")
            if call.cycle <= session.cycle:
                raise StaleCycleError(f"request {call.request_id!r}: cycle {call.cycle} is stale "
                                      f"(last {session.cycle})")
            noticed = self._apply(session, call)
            gamma = self._room(len(session.tokens), call.gamma)
            if gamma <= 0:
                return DraftBlock(tokens=[])
            block = self._without_drafting(session, call.request_id, gamma, noticed)
            if block is not None:
                return block
            item = _Queued(call.request_id, gamma)
            self._queue.append(item)
        self._wake.set()
        return await item.done

    def _apply(self, session: _DraftSession, call: DraftCall) -> bool:
        """Apply a call's delta (a draft request's, or a notice's for a pushed block) → whether the request drafted
        ahead for the cycle before (a hit or a miss follows)."""
        self._check_delta(session, call.new_ids, call.feature_start, call.features)
        self._drop_ahead(call.request_id)  # a notice not started yet is stale now: its outcome is known
        noticed = session.notice_at is not None
        if noticed:
            self.window.observe_window(time.monotonic() - session.notice_at)
            session.notice_at = None
        self.proposers[session.method].commit(call.request_id, call.feature_start, call.features)
        session.tokens.extend(call.new_ids)
        session.features += 0 if call.features is None else len(call.features)
        session.cycle = call.cycle
        session.lease.touch()
        return noticed

    async def ahead(self, call: AheadCall) -> list[Pushed]:
        """`notice`, then its blocks once drafted."""
        return await (await self.notice(call))

    async def notice(self, call: AheadCall) -> asyncio.Future:
        """The block answered for `cycle` (or with `taken`, the block pushed for the outcome its delta shows) was
        cut to `verify_len` drafts and sent: draft ahead of its outcomes (proposers with a speculation cache,
        `drafter_worker/ahead.py`), after any draft request waiting. → a future of the blocks to push: the first
        piece drafted (the likeliest outcomes), or none if no piece was drafted before the request's next draft
        request. A stale or unknown cycle, or a proposer without a cache, gets none at once: drafting ahead is an
        optimisation. `accept` (the router's ĉ_k of the verified drafts) replaces the block's own estimate in
        choosing the outcomes."""
        request_id, cycle, verify_len, accept = call.request_id, call.cycle, call.verify_len, call.accept
        self._check_open()
        nothing = asyncio.get_running_loop().create_future()
        nothing.set_result([])
        async with self._lock:
            session = self._sessions.get(request_id)
            if session is None:
                return nothing
            if call.taken is not None and cycle > session.cycle:
                self._take(session, call.taken)
            if session.cycle != cycle or session.last is None:
                return nothing
            block, gamma = session.last
            session.last, session.notice_at, session.gamma = None, time.monotonic(), gamma
            if not hasattr(self.proposers[session.method], "speculation"):
                return nothing
            block = block.head(verify_len)
            if accept:  # the outcome rule reads a block's confidences as its ĉ_k: the router's measured ones win
                block = replace(block, confidences=list(accept[: len(block)]))
            job = _AheadJob(request_id, block, gamma)
            self._ahead.append(job)
        self._wake.set()
        return job.pushed

    def _take(self, session: _DraftSession, call: DraftCall) -> None:
        """The router verifies the block this replica pushed for the outcome `call`'s delta shows: apply the delta
        and take that block from the cache as the one sent (a hit). Gone from the cache (a reopen between): no
        block to draft ahead of."""
        noticed = self._apply(session, call)
        cached = getattr(self.proposers[session.method], "cached", None)
        block = cached(call.request_id, session.tokens, session.gamma) if cached is not None and noticed else None
        session.last = None if block is None else (block, session.gamma)

    def _without_drafting(self, session: _DraftSession, request_id: str, gamma: int, noticed: bool
                          ) -> DraftBlock | None:
        """A hit is answered at once, without the batch window or the compute thread; a miss while the replica is
        saturated (`fallback_queue` drafts waiting) gets an empty block, so the request decodes plainly this
        cycle instead of waiting (SSD's fallback at large batch). None: draft as usual."""
        cached = getattr(self.proposers[session.method], "cached", None)
        block = cached(request_id, session.tokens, gamma) if cached is not None and noticed else None
        if block is not None:
            session.last = (block, gamma)
            return block
        if noticed and self.fallback_queue and len(self._queue) >= self.fallback_queue:
            self.fallbacks += 1
            return DraftBlock(tokens=[])
        return None

    async def release(self, request_id: str) -> bool:
        async with self._lock:
            return self._forget(request_id)

    def load(self) -> DrafterLoad:
        return DrafterLoad(len(self._sessions), len(self._queue), self.timer.ema_ms, self.timer.steps)

    # ---- internals ----------------------------------------------------------------------------
    def _check_length(self, tokens: int) -> None:
        """The anchor (position tokens − 1) must have a position for the first draft it predicts."""
        if self.limits.positions is not None and tokens > self.limits.positions:
            raise InvalidRequestError(f"context of {tokens} tokens; the drafters hold {self.limits.positions}")

    def _featureless(self, rows: int) -> bool:
        """No features sent to proposers that read none (n-gram, test fakes: no draft model, so no feature width)."""
        return rows == 0 and self.limits.feature_width is None

    def _room(self, tokens: int, gamma: int) -> int:
        """γ cut so that every drafted position stays inside the position table (a shorter block is allowed)."""
        return gamma if self.limits.positions is None else min(gamma, self.limits.positions - tokens + 1)

    def _check_delta(self, session: _DraftSession, new_ids, feature_start, features) -> None:
        self._check_length(len(session.tokens) + len(new_ids))
        rows = 0 if features is None else len(features)
        if rows and feature_start != session.features:
            raise InvalidRequestError(f"features start at {feature_start}, the context has {session.features}")
        if (session.features + rows != len(session.tokens) + len(new_ids) - 1
                and not (self._featureless(rows) and session.features == 0)):  # once sent, always sent
            raise InvalidRequestError(f"after this delta {len(session.tokens) + len(new_ids)} tokens would have "
                                      f"{session.features + rows} feature rows; every position before the anchor "
                                      "needs one")

    def _expire(self, request_id: str) -> None:
        """A context no stream carried for `lease_s` (its router went away between Open and Draft, or between two
        streams), freed as the verifier's lease frees KV slots."""
        self._forget(request_id)

    def _forget(self, request_id: str) -> bool:
        session = self._sessions.pop(request_id, None)
        if session is not None:
            self.proposers[session.method].release(request_id)
        for item in [q for q in self._queue if q.request_id == request_id]:
            self._queue.remove(item)
            item.done.cancel()
        self._drop_ahead(request_id)
        return session is not None

    def _drop_ahead(self, request_id: str) -> None:
        for job in [j for j in self._ahead if j.request_id == request_id]:
            self._ahead.remove(job)
            job.push([])

    async def _steps(self) -> None:
        async with self._lock:
            batch, self._queue = self._queue, []
            if not batch:
                ahead, self._ahead = self._ahead, []
            else:
                await self._draft_batch(batch)
                ahead = []
        if ahead:
            await self._run_ahead(ahead)

    async def _draft_batch(self, batch: list[_Queued]) -> None:
        try:
            blocks = await self.compute(self._propose_all, batch)
        except Exception as error:
            for item in batch:
                if not item.done.done():
                    item.done.set_exception(error)
            return
        for item in batch:
            block = blocks.get(item.request_id, DraftBlock(tokens=[]))
            session = self._sessions.get(item.request_id)
            if session is not None:
                session.last = (block, item.gamma)
            if not item.done.done():
                item.done.set_result(block)
        if self._ahead:
            self._wake.set()  # notices that came in during the step

    async def _run_ahead(self, jobs: list[_AheadJob]) -> None:
        """Draft ahead piece by piece (not timed as draft steps), the lock taken per piece, and stop as soon as a
        draft request waits or the next piece would not fit in the verify window (`ahead_window.py`): drafting
        ahead must never delay drafting. Each notice is answered after its first piece (or with nothing if none
        was drafted); the later pieces stay in the cache for the next draft request."""
        loop = asyncio.get_running_loop()
        notices = [s.notice_at for s in (self._sessions.get(job.request_id) for job in jobs) if s and s.notice_at]
        started, done = self.window.start(min(notices, default=None)), 0
        try:
            for group, pieces in self._speculations(jobs):
                while not self._queue and self.window.fits(started, done):
                    async with self._lock:
                        t0 = time.monotonic()
                        piece = await loop.run_in_executor(self._compute, next, pieces, StopIteration)
                        if piece is StopIteration:
                            break
                        self.window.observe_piece(time.monotonic() - t0)
                        done += 1
                    for job in group:
                        job.push([Pushed(o.accepted, o.token, b) for o, b in piece.get(job.request_id, {}).items()])
                if self._queue or not self.window.fits(started, done):
                    return
        finally:
            for job in jobs:
                job.push([])

    def _speculations(self, jobs: list[_AheadJob]):
        """(its notices, one piecewise speculation) per (method, γ) group of the notices."""
        groups: dict[tuple[str, int], list[_AheadJob]] = {}
        for job in jobs:
            if job.request_id in self._sessions:
                groups.setdefault((self._sessions[job.request_id].method, job.gamma), []).append(job)
        for (method, gamma), group in groups.items():
            sent = {job.request_id: (list(self._sessions[job.request_id].tokens), job.block) for job in group}
            params = {rid: self._sessions[rid].params for rid in sent}
            yield group, self.proposers[method].speculation(sent, gamma, params)

    def _ready(self) -> bool:
        if self._ahead and not self._queue:
            return True  # drafting ahead starts at once (a draft request arriving meanwhile waits for it)
        return len({item.request_id for item in self._queue}) >= len(self._sessions)

    def _propose_all(self, batch: list[_Queued]) -> dict[str, DraftBlock]:
        """One batched propose per (method, γ) group of the queued requests."""
        groups: dict[tuple[str, int], list[str]] = {}
        for item in batch:
            groups.setdefault((self._sessions[item.request_id].method, item.gamma), []).append(item.request_id)
        blocks = {}
        for (method, gamma), rids in groups.items():
            contexts = {rid: self._sessions[rid].tokens for rid in rids}
            params = {rid: self._sessions[rid].params for rid in rids}
            blocks.update(self.proposers[method].propose(contexts, gamma, params))
        return blocks


class LocalDrafter:
    """A `DrafterService` in this process, as the router's `DrafterTier`."""

    def __init__(self, service: DrafterService):
        self.service = service

    async def open(self, call: OpenCall) -> None:
        await self.service.open(call)

    async def draft(self, call: DraftCall) -> DraftBlock:
        return await self.service.draft(call)

    async def ahead(self, call: AheadCall) -> list[Pushed]:
        return await self.service.ahead(call)

    async def release(self, request_id) -> None:
        await self.service.release(request_id)

    def forget(self, request_id) -> None:
        """Nothing to cut: in process there is no stream."""

"""The tiered router core: sessions and the cycle loop (draft → schedule → verify → commit) over a
verifier tier and a drafter tier reached through `router/tiers/protocol.py` protocols (gRPC or in-process).

Each request runs as its own coroutine; batching happens in the tiers, which serve many streams per
step. The router is the ground truth of every session (committed tokens), so it recovers from a lost
drafter (plain decoding, then reopening the context from the stored features) and from a lost
verifier (re-prefill from the committed tokens) without losing or changing the request's output.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from opentelemetry import trace

from router.ahead_notice import ahead_notice
from router.metrics import RouterMetrics
from router.scheduling.planner import CycleRecord, Decision, VerifyPlanner
from router.scheduling.policy import Policy, max_verify_len
from router.session import Chunk, RouterRequest, Session, Speculation, resolve
from router.text_stream import TextStream
from router.tiers.protocol import DrafterTier, VerifierTier
from services.calls import PrefillCall, VerifyCall
from services.errors import CapacityError, InvalidRequestError, StaleCycleError, TierUnavailableError
from services.tokenizer import TextTokenizer
from services.tracing import current_traceparent
from services.types import DraftBlock, PlainRun, Prefilled, StepOutput, Verified

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    default: Speculation = field(default_factory=Speculation)
    max_gamma: int = 16
    threshold: float = 0.3  # λ of the THRESHOLD policy: verify while prefix survival a_k ≥ λ
    max_running: int = 64  # concurrent sessions
    max_queue: int = 256  # sessions waiting for a running slot; beyond it requests get CapacityError
    reattach_every: int = 16  # most cycles between attempts to reopen a lost drafter (backoff 1, 2, 4, ...)
    verifier_retry_s: float = 30.0  # how long a session keeps re-prefilling on a lost verifier
    plain: PlainRun | None = field(default_factory=PlainRun)  # how method none runs ahead on the verifier (None: not)
    # A dspark request whose plan says drafting does not pay is handed to such a plain run for the rest of its
    # life (its plain cycles then cost what method none's do, not a round trip per token).
    plain_handoff: bool = True


class RouterObserver(Protocol):
    """What a caller in process learns of each request beyond its chunks (`in_process/`: τ, acceptance per
    position, calibration records, the request's own time)."""

    def running(self, request_id: str) -> None:
        """The request took a running slot: its queueing ends, its prefill starts."""

    def verified(self, request_id: str, block: DraftBlock | None, output: StepOutput, pushed: bool) -> None:
        """A cycle came back: the block sent (its first ℓ drafts, or None), the verifier's outcome, and whether
        the block was pushed by the drafter (held when the verification before ended: no draft request)."""


class Router:
    def __init__(self, verifier: VerifierTier, drafter: DrafterTier | None, methods: set[str],
                 config: RouterConfig | None = None, tokenizer: TextTokenizer | None = None,
                 tracer: trace.Tracer | None = None, metrics: RouterMetrics | None = None, model: str = "",
                 planner: VerifyPlanner | None = None, observer: RouterObserver | None = None):
        self.verifier, self.drafter, self.methods = verifier, drafter, methods if drafter else set()
        self.observer = observer
        self.config = config or RouterConfig()
        self.tokenizer, self.model = tokenizer, model
        self.tracer = tracer or trace.NoOpTracer()
        self.metrics = metrics or RouterMetrics(model=model)
        self.planner = planner or VerifyPlanner(self.config.threshold)
        self._slots = asyncio.Semaphore(self.config.max_running)
        self._tasks: list[asyncio.Task] = []
        self._active: set[str] = set()  # request ids in flight
        self.waiting = self.running = 0

    async def start(self, *background: Callable[[], Awaitable[None]]) -> None:
        """Background work off the request path: the verifier's SPS profile, the load board, and `background`
        (e.g. keeping the replica pools current)."""
        self._tasks = [asyncio.create_task(run()) for run in background]
        self._tasks.append(asyncio.create_task(self._fetch_profile()))
        if self.planner.board is not None:
            self._tasks.append(asyncio.create_task(self.planner.board.run()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _fetch_profile(self) -> None:
        while True:
            try:
                profile = await self.verifier.profile()
            except Exception as error:  # the verifier may still be starting
                log.info("verifier profile not available yet (%s)", error)
                await asyncio.sleep(1.0)
                continue
            self.planner.set_profile(profile.engine_id, profile.sps)
            log.info("verifier %s: SPS profile of %d points", profile.engine_id, len(profile.sps))
            return

    def speculation(self, options: dict | None) -> Speculation:
        return resolve(options, self.config.default, self.methods, self.config.max_gamma)

    def check_capacity(self) -> None:
        """CapacityError when a new request would find the queue full (the API answers 429)."""
        if self.running + self.waiting >= self.config.max_running + self.config.max_queue:
            self.metrics.rejected.labels(self.model, "queue_full").inc()
            raise CapacityError(f"router queue is full ({self.config.max_queue} waiting)")

    async def generate(self, request: RouterRequest) -> AsyncIterator[Chunk]:
        """Stream the request's output, one chunk for the first token and one per cycle after it."""
        spec = request.speculative
        if not isinstance(spec, Speculation):
            spec = self.speculation(spec)
        rid = request.request_id
        if rid in self._active:  # its release would free the other request's KV slot and context
            raise InvalidRequestError(f"request id {rid!r} is already in flight")
        self.check_capacity()
        self._active.add(rid)
        try:
            async with contextlib.aclosing(self._admitted(request, spec)) as chunks:  # closed with this one
                async for chunk in chunks:
                    yield chunk
        finally:
            self._active.discard(rid)

    async def _admitted(self, request: RouterRequest, spec: Speculation) -> AsyncIterator[Chunk]:
        self.waiting += 1
        self.metrics.waiting.labels(self.model).inc()
        try:
            if request.follows:  # before taking a running slot: the leader may still need one
                await asyncio.shield(request.prefix.done)
            await self._slots.acquire()
        finally:
            self.waiting -= 1
            self.metrics.waiting.labels(self.model).dec()
        self.running += 1
        self.metrics.running.labels(self.model).inc()
        if self.observer is not None:
            self.observer.running(request.request_id)
        text = TextStream(self.tokenizer, request.stop, request.include_stop, request.skip_special,
                          request.params.min_tokens)
        session = Session(request, spec, text)
        try:
            async for chunk in self._serve(session):
                yield chunk
        finally:
            if request.prefix is not None and not request.prefix.done.done():  # a leader that never prefilled
                request.prefix.done.set_result(None)
            try:  # the tiers first: the next request admitted must find this one's KV slot free
                await asyncio.shield(self._release(session))
            finally:
                self.running -= 1
                self.metrics.running.labels(self.model).dec()
                self.planner.leave(session.request.request_id)
                self._slots.release()

    async def _serve(self, s: Session) -> AsyncIterator[Chunk]:
        rid = s.request.request_id
        attrs = {"dspark.request_id": rid, "gen_ai.request.model": self.model, "dspark.method": s.spec.method,
                 "dspark.policy": str(s.spec.policy), "dspark.gamma": s.spec.gamma,
                 "gen_ai.request.max_tokens": s.params.max_tokens, "gen_ai.request.temperature": s.params.temperature,
                 "gen_ai.usage.input_tokens": len(s.request.prompt_ids)}
        with self.tracer.start_as_current_span("request", attributes=attrs) as span:
            with self.tracer.start_as_current_span("prefill"):
                pre = await self._prefill(s, resume=False)
            s.first_token_s = time.perf_counter() - s.started
            self.metrics.ttft.labels(self.model).observe(s.first_token_s)
            s.add_features(0, self._prompt_features(s, pre))
            self.planner.join(rid)  # every decoding request is an anchor in the verifier's steps
            first = self._chunk(s, *s.commit(pre.emitted, pre.logprobs))
            first.prompt_logprobs = pre.prompt_logprobs
            yield first
            while s.finish_reason() is None:
                yield await self._cycle(s)
            finish = s.finish_reason()
            tail = s.text.flush()
            span.set_attributes({"gen_ai.usage.output_tokens": len(s.output),
                                 "gen_ai.response.finish_reasons": [str(finish)], "dspark.cycles": s.cycle})
            self.metrics.finished(str(finish), len(s.request.prompt_ids), len(s.output), s.first_token_s,
                                  time.perf_counter() - s.started)
            yield self._chunk(s, [], tail, finish=finish)

    async def _cycle(self, s: Session) -> Chunk:
        s.cycle += 1
        started = time.perf_counter()
        with self.tracer.start_as_current_span("cycle", attributes={"dspark.cycle": s.cycle}) as span:
            bound = max_verify_len(s.spec.policy, s.spec.gamma, s.remaining)
            block = await self._draft(s, bound) if bound > 0 and not s.handed_off else None
            held = block is not None and block is s.link.ready  # pushed with the last notice's reply: no draft call
            s.link.ready = None  # held for this cycle only
            decision = None
            if block:
                block, decision = self._schedule(s, block, bound)
            ahead = (ahead_notice(self.drafter, s, block, decision, held, current_traceparent()) if s.link.ok
                     else None)
            with self.tracer.start_as_current_span("verify") as vspan:
                sent = time.perf_counter()
                done = await self._verify(s, block, self._handoff(s, block))
                out = done.output
                if self.observer is not None:
                    self.observer.verified(s.request.request_id, block, out, held)
                vspan.set_attributes({"dspark.verify_len": out.num_drafts, "dspark.accepted": out.num_accepted})
            # What the drafter pushed by the time the verification ended; a reply still on its way is not waited
            # for: the next draft request follows the notice on the stream (and is answered from the cache).
            pushed = ahead.result() if ahead is not None and ahead.done() else []
            if s.link.ahead_sent and block is not None:  # this cycle's block followed an ahead notice
                self.metrics.ahead(block.ahead, out.num_accepted, s.link.pushed if held else block.fanout, held)
            s.link.ahead_sent = ahead is not None
            verified_at = time.perf_counter()
            if not s.handed_off:  # a plain run's reply: several steps, none a plan's cycle, features no drafter needs
                self.planner.observe(CycleRecord(s.request.request_id, s.spec.policy, s.spec.method,
                                                 s.params.greedy, decision, out.num_drafts, out.num_accepted,
                                                 verified_at - sent, verified_at - started,
                                                 bool(block and block.ahead)))
                s.add_features(out.feature_start, out.features)
            self.metrics.cycle(out.num_drafts, out.num_accepted)
            s.observe_cycle(verified_at - started)
            kept, text, logprobs = s.commit(out.emitted, out.logprobs)
            s.link.take(pushed, out.num_accepted, out.emitted)
            span.set_attributes({"dspark.verify_len": out.num_drafts, "dspark.accepted": out.num_accepted,
                                 "dspark.emitted": len(kept), "dspark.plain_run": s.handed_off})
            return self._chunk(s, kept, text, logprobs=logprobs)

    def _handoff(self, s: Session, block: DraftBlock | None) -> PlainRun | None:
        """The plain run to hand this request to, now: a dspark request that skipped drafting this cycle because
        its plan says drafting does not pay at this load. One way (no probe follows); depends on the plan, which
        rests on past cycles only, so the output is plain decoding's either way."""
        if (s.handed_off or block is not None or not s.skipped_draft or not self.config.plain_handoff
                or self.config.plain is None):
            return None
        s.handed_off = True
        self.metrics.plain_handoffs.labels(self.model).inc()
        return self.config.plain

    def _schedule(self, s: Session, block: DraftBlock, bound: int) -> tuple[DraftBlock, Decision]:
        """Trim a block to the ℓ the planner decides (at most `bound`, γ and the token budget)."""
        with self.tracer.start_as_current_span("schedule") as span:
            t0 = time.perf_counter()
            d = self.planner.decide(s.request.request_id, s.spec.policy, s.spec.method, s.params.greedy, block,
                                    bound, s.spec.min_tokens_per_s * s.cycle_s)
            source = None if d.plan is None else d.plan.source
            self.metrics.scheduled(d.drafted, d.verify_len, time.perf_counter() - t0,
                                   None if d.plan is None else d.plan.budget, source)
            attrs = {"dspark.verify_len": d.verify_len, "dspark.drafted": d.drafted,
                     "dspark.survival": d.survivals[d.verify_len - 1] if d.verify_len else 1.0}
            if d.plan is not None:
                attrs |= {"dspark.budget": d.plan.budget, "dspark.lambda": d.plan.threshold,
                          "dspark.planned_batch_tokens": d.plan.batch_tokens, "dspark.load_source": source}
            span.set_attributes(attrs)
        return block.head(d.verify_len), d

    # ---- drafter ------------------------------------------------------------------------------
    async def _open_drafter(self, s: Session) -> None:
        try:
            await self.drafter.open(s.open_call(current_traceparent()))
            s.link.opened()
        except Exception as error:
            self._detach(s, error)

    async def _draft(self, s: Session, bound: int) -> DraftBlock | None:
        if self.drafter is None or s.spec.policy is Policy.NONE:
            return None
        s.skipped_draft = not self.planner.wants_draft(s.request.request_id, s.spec.policy, s.spec.min_tokens_per_s)
        if s.skipped_draft:
            self.metrics.drafts_skipped.labels(self.model).inc()
            self.metrics.scheduler_cycles.labels(self.model, self.planner.source(s.request.request_id)).inc()
            return None  # the delta keeps growing; the next draft carries it
        if not s.link.ok:  # opened at the first draft (dspark may never need one), reopened after a loss
            if s.link.backing_off(s.cycle):
                return None
            await self._open_drafter(s)
            if not s.link.ok:
                return None
        if s.link.ready is not None:  # pushed for the outcome the verification before showed
            return s.link.ready
        with self.tracer.start_as_current_span("draft", attributes={"dspark.gamma": s.spec.gamma}) as span:
            try:
                block = await self.drafter.draft(s.draft_call(current_traceparent()))
            except Exception as error:
                self._detach(s, error)
                return None
            span.set_attributes({"dspark.drafted": len(block), "dspark.ahead": block.ahead})
            s.link.drafted()
            return block

    def _detach(self, s: Session, error: Exception) -> None:
        log.warning("request %s: drafter lost (%s); decoding without it", s.request.request_id, error)
        s.link.lost(s.cycle, self.config.reattach_every)  # reopened at once (elsewhere in a pool), then backing off
        self.metrics.drafter_detached.labels(self.model).inc()

    # ---- verifier -----------------------------------------------------------------------------
    def _prompt_features(self, s: Session, pre: Prefilled) -> torch.Tensor | None:
        """Features of every prompt position: a sample that copied its leader's cached prefix gets the rows
        before `feature_start` from the leader; a leader hands its own on to its samples."""
        prefix = s.request.prefix
        feats = pre.features
        if pre.feature_start:
            feats = torch.cat([prefix.done.result()[: pre.feature_start], feats])
        if prefix is not None and not prefix.done.done():
            prefix.done.set_result(feats)
        return feats

    async def _prefill(self, s: Session, resume: bool) -> Prefilled:
        """Prefill (or re-prefill from the committed tokens), retrying a lost verifier until the deadline."""
        deadline = time.monotonic() + self.config.verifier_retry_s
        # prompt logprobs once: a re-prefill's prompt was already answered for
        params = dataclasses.replace(s.params, max_tokens=max(1, s.remaining),
                                     prompt_logprobs=None if resume else s.params.prompt_logprobs)
        share = ""  # a sample copies its leader's cached prompt when the leader's features are at hand
        if not resume and s.request.follows and s.request.prefix.done.result() is not None:
            share = s.request.prefix.leader
        while True:
            try:
                plain = self.config.plain if s.spec.method == "none" or s.handed_off else None
                return await self.verifier.prefill(PrefillCall(s.request.request_id, s.request.prompt_ids, params,
                                                               list(s.output) if resume else [],
                                                               current_traceparent(), share, plain))
            except TierUnavailableError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def _verify(self, s: Session, block: DraftBlock | None, plain: PlainRun | None = None) -> Verified:
        """`plain`: hand the request to a plain run with this call (after a re-prefill it is prefilled as one)."""
        for _ in range(3):
            try:
                done = await self.verifier.verify(VerifyCall(s.request.request_id, s.vcycle + 1, block,
                                                             current_traceparent(), plain))
                s.vcycle += 1
                return done
            except (TierUnavailableError, StaleCycleError) as error:
                log.warning("request %s: verifier lost (%s); re-prefilling", s.request.request_id, error)
                self.metrics.verifier_reprefills.labels(self.model).inc()
                await self.verifier.release(s.request.request_id)
                await self._prefill(s, resume=True)
                s.vcycle = 0
        raise TierUnavailableError(f"request {s.request.request_id}: verifier keeps failing")

    async def _release(self, s: Session) -> None:
        rid = s.request.request_id
        await self.verifier.release(rid)
        if self.drafter is not None and s.spec.policy is not Policy.NONE:
            await self.drafter.release(rid)

    def _chunk(self, s: Session, tokens: list[int], text: str, logprobs=None, finish=None) -> Chunk:
        return Chunk(s.request.request_id, tokens, text, finish, len(s.request.prompt_ids), len(s.output), s.cycle,
                     logprobs)


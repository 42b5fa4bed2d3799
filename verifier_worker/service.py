"""The verifier tier's async core: many sessions, one engine step loop (no gRPC, no Ray).

Sessions call `prefill`, `verify` and `release` from any coroutine; one loop task runs `Engine.step`
in a worker thread whenever there is work, so one ragged forward serves every stream that has a cycle
pending (continuous batching across streams). The engine is touched only under `_lock`, which the
loop holds for the duration of a step: admissions, submissions and releases land between steps.

Cycle bookkeeping: after prefill a request is at cycle 0; `verify` must carry the next cycle, anything
else is stale (`StaleCycleError`) and changes nothing. A request prefilled with a `PlainRun` decodes
plainly before its verify calls ask (`verifier_worker/plain_run.py`); each call takes the steps done since
the last one.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import torch

from services.calls import PrefillCall, VerifyCall
from services.errors import InvalidRequestError, StaleCycleError, TierUnavailableError
from services.lease import Lease
from services.tier_loop import TierLoop
from services.types import (
    OutcomeKind,
    Prefilled,
    StepOutput,
    TokenLogprobs,
    Verified,
    VerifierLoad,
    VerifierProfile,
)
from verifier_worker.engine import Engine
from verifier_worker.plain_run import PlainRunState, check_plain_run

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _VerifySession:
    cycle: int = 0
    lease: Lease = field(default_factory=Lease)  # Verify streams attached; freed once none has for lease_s
    prefilled: bool = False
    features: list[torch.Tensor] = field(default_factory=list)  # prefill chunks so far
    prompt_logprobs: TokenLogprobs | None = None  # prefill chunks so far, when asked for
    feature_start: int = 0  # position of the first prefill chunk (> 0 after a shared prefix)
    waiter: asyncio.Future | None = None
    plain: PlainRunState | None = None  # plain steps done before the router asks (prefilled with a PlainRun)


class VerifierService(TierLoop):
    role = "verifier"

    def __init__(self, engine: Engine, model_name: str = "", lease_s: float = 60.0, batch_window_s: float = 0.005):
        super().__init__(lease_s, batch_window_s)
        self.engine, self.model_name = engine, model_name
        self._sessions: dict[str, _VerifySession] = {}

    # ---- session calls ------------------------------------------------------------------------
    async def prefill(self, call: PrefillCall) -> Prefilled:
        """`call.plain`: the request is plain for its whole life; decode before the router asks, as it says."""
        request_id, prompt_ids, params, plain = call.request_id, call.prompt_ids, call.params, call.plain
        resume_ids = call.resume_ids
        self._check_open()
        if plain is not None:
            check_plain_run(plain)
        async with self._turn():
            if request_id in self._sessions:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self.engine.add_request(request_id, prompt_ids, params, resume_ids, call.share_prefix_of)
            session = self._sessions[request_id] = _VerifySession()
            if plain is not None:
                session.plain = PlainRunState(plain, params)
            session.waiter = asyncio.get_running_loop().create_future()
        self._wake.set()
        try:
            out: StepOutput = await session.waiter
        except asyncio.CancelledError:
            await self.release(request_id)
            raise
        feats = torch.cat(session.features) if session.features else None
        prompt_logprobs, session.prompt_logprobs = session.prompt_logprobs, None
        session.features, session.prefilled = [], True
        committed = len(prompt_ids) + len(resume_ids) + len(out.emitted)
        rows = committed - 1 - session.feature_start
        return Prefilled(out.emitted, committed, None if feats is None else feats[:rows], out.logprobs,
                         prompt_logprobs, session.feature_start)

    async def verify(self, call: VerifyCall) -> Verified:
        """`call.plain`: from this call on the request decodes plainly before it is asked (a hand-off: no draft may
        come again)."""
        request_id, cycle, draft, plain = call.request_id, call.cycle, call.draft, call.plain
        self._check_open()
        if plain is not None:
            check_plain_run(plain)
            if draft:
                raise InvalidRequestError("plain_depth comes with an empty draft (it ends drafting)")
        async with self._turn():
            session = self._sessions.get(request_id)
            if session is None or session.waiter is not None:
                state = "unknown" if session is None else "busy"
                raise StaleCycleError(f"request {request_id!r} is {state}")
            if cycle != session.cycle + 1:
                raise StaleCycleError(f"request {request_id!r}: cycle {cycle} is stale, expected {session.cycle + 1}")
            if plain is not None and session.plain is None:
                session.plain = PlainRunState(plain, self.engine.params(request_id),
                                              emitted=self.engine.num_emitted(request_id))
            steps = session.plain
            if steps is not None and draft:
                raise InvalidRequestError(f"request {request_id!r} decodes plainly: no drafts")
            if steps is not None and steps.ready():  # taken at once; the step after them is queued
                out = steps.take()
                self._queue_plain(request_id, session)
            else:
                if self.engine.is_ready(request_id):  # none queued (or no plain run): this call's step
                    self.engine.submit(request_id, draft)
                session.waiter = asyncio.get_running_loop().create_future()
                out = None
        self._wake.set()
        if out is None:
            out = await session.waiter
        session.cycle = cycle
        session.lease.touch()
        return Verified(out, self.engine.num_tokens(request_id) - (steps.untaken() if steps else 0))

    async def release(self, request_id: str) -> bool:
        async with self._turn():
            return self._drop(request_id, asyncio.CancelledError())

    def load(self) -> VerifierLoad:
        usage = self.engine.cache.usage()
        return VerifierLoad(
            running=self.engine.num_running, waiting=self.engine.num_waiting, kv_used=usage.tokens_used,
            kv_total=usage.tokens_total, step_ms_ema=self.timer.ema_ms, steps=self.timer.steps,
            streams=sum(s.lease.streams for s in self._sessions.values()), batch_tokens=self.engine.last_batch_tokens,
        )

    # ---- internals ----------------------------------------------------------------------------
    def _drop(self, request_id: str, reason: BaseException) -> bool:
        session = self._sessions.pop(request_id, None)
        self.engine.release(request_id)
        self._wake.set()  # a prefill queued for a slot may take this one now
        if session is not None and session.waiter is not None and not session.waiter.done():
            session.waiter.set_exception(reason)
        return session is not None

    async def _steps(self) -> None:
        while self.engine.has_work():
            async with self._lock:
                try:
                    outputs = await self.compute(self._step)
                except Exception:
                    self._fail_all()
                    return
                for out in outputs:
                    self._deliver(out)
            if not outputs:
                return  # waiting requests with every slot taken by idle sessions: wait for a release

    def _step(self) -> list[StepOutput]:
        """In the compute thread, under `_lock`: one engine step; then, while the engine steps plain runs only, no
        session call waits for the lock and no reply is due, their next steps here, with no hop through the event
        loop between two of them (the loop thread's wake-ups cost a step of this size a fifth of its time)."""
        last = self._absorb(self.engine.step())
        outputs = list(last)
        while last and self._knocking == 0 and self._only_plain_runs():
            last = self._absorb(self.engine.step())
            outputs += last
        return outputs

    def _absorb(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """A plain run's step joins its run's done steps and queues the next (`_deliver` answers the call)."""
        for out in outputs:
            session = self._sessions.get(out.request_id)
            if session is not None and session.plain is not None and out.kind not in (None, OutcomeKind.FIRST):
                session.plain.record(out)
                session.plain.done.append(out)
                self._queue_plain(out.request_id, session)
        return outputs

    def _only_plain_runs(self) -> bool:
        """The next step would serve plain runs only, and none of them has a reply due."""
        queued = self.engine.queued_cycles()
        if not queued:
            return False
        for rid in queued:
            session = self._sessions.get(rid)
            if session is None or session.plain is None or (session.waiter is not None and session.plain.ready()):
                return False
        return True

    def _on_stop(self, reason: BaseException) -> None:
        for rid in list(self._sessions):
            self._drop(rid, reason)

    def _fail_all(self) -> None:
        """A step raised: its batch's state is unknown, so every request here is dropped as if this replica had
        been lost (the router re-prefills them, from its committed tokens) and the loop serves on. A dead loop
        behind a SERVING health check would hang every later call."""
        log.exception("verifier step failed; dropping its %d requests", len(self._sessions))
        for rid in list(self._sessions):
            self._drop(rid, TierUnavailableError("verifier step failed"))

    def _ready(self) -> bool:
        """Every prefilled session has its next cycle queued."""
        return not any(s.prefilled and s.waiter is None and s.plain is None for s in self._sessions.values())

    def _deliver(self, out: StepOutput) -> None:
        session = self._sessions.get(out.request_id)
        if session is None:
            return
        if out.kind is None or out.kind is OutcomeKind.FIRST:
            if out.features is not None:
                if not session.features:
                    session.feature_start = out.feature_start
                session.features.append(out.features)
            if out.prompt_logprobs is not None:
                session.prompt_logprobs = session.prompt_logprobs or TokenLogprobs()
                session.prompt_logprobs.extend(out.prompt_logprobs)
            if out.kind is None:
                return
        if session.plain is not None:
            self._deliver_plain(out, session)
            return
        self._resolve(session, out)

    def _deliver_plain(self, out: StepOutput, session: _VerifySession) -> None:
        """The prefill's first token goes to its caller, and the run's first step is queued; a plain step (absorbed
        in the compute thread) answers the verify call waiting once a reply is due."""
        steps = session.plain
        if out.kind is OutcomeKind.FIRST:
            steps.record(out)
            self._resolve(session, out)
            self._queue_plain(out.request_id, session)
        elif session.waiter is not None and steps.ready():
            self._resolve(session, steps.take())

    def _queue_plain(self, request_id: str, session: _VerifySession) -> None:
        if not session.plain.wants_step() or not self.engine.is_ready(request_id):
            return
        try:
            self.engine.submit(request_id, None)
        except InvalidRequestError:  # the slot is full: the router's next call meets the same error itself
            session.plain.ended = True

    @staticmethod
    def _resolve(session: _VerifySession, out: StepOutput) -> None:
        waiter, session.waiter = session.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(out)

    def _expired(self, session: _VerifySession, now: float) -> bool:
        """Prefilled but never attached, or left between two streams (a request mid-cycle is not freed)."""
        return session.waiter is None and session.lease.expired(self.lease_s, now)

    def _expire(self, request_id: str) -> None:
        self._drop(request_id, TierUnavailableError("lease expired"))


class LocalVerifier:
    """A `VerifierService` in this process, as the router's `VerifierTier` (tests, benchmarks, embedded use)."""

    def __init__(self, service: VerifierService, profile: VerifierProfile | None = None):
        self.service, self._profile = service, profile or VerifierProfile("local")

    async def prefill(self, call: PrefillCall) -> Prefilled:
        return await self.service.prefill(call)

    async def verify(self, call: VerifyCall) -> Verified:
        return await self.service.verify(call)

    async def release(self, request_id) -> None:
        await self.service.release(request_id)

    def forget(self, request_id) -> None:
        """Nothing to cut: in process there is no stream (a pool calls this when it gives up on a replica)."""

    async def profile(self) -> VerifierProfile:
        return self._profile

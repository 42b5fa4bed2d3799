"""In-process router: sessions and the cycle loop (draft → schedule → verify → commit) over one
`LocalEngine` and one optional `Proposer`, batching every active request into each engine step."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from router.scheduling.planner import CycleRecord, Decision, VerifyPlanner
from router.scheduling.policy import Policy, max_verify_len
from router.session import finish_reason, keep
from services.errors import CapacityError
from services.types import DraftBlock, FinishReason, OutcomeKind, Proposer, SamplingParams, StepOutput, TokenLogprobs


class LocalEngine(Protocol):
    """What the in-process router needs of the verifier's engine (`verifier_worker.engine.LocalEngine` is one): it is
    handed an engine by its caller (training, evaluation, `dspark generate`) and never imports a worker."""

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None: ...

    def tokens(self, request_id: str) -> list[int]: ...

    def submit(self, request_id: str, draft: DraftBlock | None = None) -> int: ...

    def step(self) -> list[StepOutput]: ...

    def release(self, request_id: str) -> None: ...

    def grammar_tokenizer(self): ...  # the target's vocabulary for llguidance (services/grammar.py)


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason
    cycles: int  # verify cycles (the first token comes from prefill, outside any cycle)
    cycle_tokens: int  # tokens emitted by cycles, accepted + 1 each, before any stop cut
    draft_tokens: int  # Σ ℓ over cycles
    accepted_tokens: int
    accepted_per_pos: list[int]  # [γ] cycles whose draft at position k was accepted
    elapsed_s: float  # from the first scheduled step (prefill) to the last token: the request's own speed
    proposed_per_pos: list[int] = field(default_factory=list)  # [γ] cycles that verified a draft at position k
    queued_s: float = 0.0  # from `generate` to the first scheduled step: the wait for a slot (KV or batch)
    logprobs: TokenLogprobs | None = None  # [len(token_ids)] when params.logprobs is set
    prompt_logprobs: TokenLogprobs | None = None  # prompt tokens 1.. when params.prompt_logprobs is set
    ahead_cycles: int = 0  # cycles verifying a block drafted ahead (drafter_worker/ahead.py)
    ahead_accepted: int = 0  # drafts accepted in them

    @property
    def tau(self) -> float:
        """Acceptance length τ: tokens emitted per cycle, bonus/recovered token included."""
        return self.cycle_tokens / self.cycles if self.cycles else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode speed over the request's own time (queueing excluded: `queued_s`)."""
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass(slots=True)
class _LocalSession:
    request: GenerationRequest
    queued: float  # when `generate` was called
    scheduled: float | None = None  # start of the first engine step that served it
    output: list[int] = field(default_factory=list)
    in_flight: bool = False
    cycles: int = 0
    cycle_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    proposed_per_pos: list[int] = field(default_factory=list)
    block: DraftBlock | None = None  # the cycle in flight
    decision: Decision | None = None  # the planner's ℓ for it
    cycle_started: float = 0.0  # when its drafting began
    ahead_cycles: int = 0  # cycles whose block was drafted ahead (a speculation-cache hit)
    ahead_accepted: int = 0  # drafts accepted in those cycles
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None

    @property
    def remaining(self) -> int:
        return self.request.params.max_tokens - len(self.output)


EXPLORE_CYCLES = 8  # whole blocks verified before threshold / dspark trust their estimates (VerifyPlanner)
OFFLINE_POLICIES = (Policy.NONE, Policy.FIXED, Policy.MTP1, Policy.THRESHOLD, Policy.DSPARK)
TokenCallback = Callable[[str, list[int]], None]
# Called once per verified cycle with the block sent (ℓ drafts, confidences) and the verifier's outcome.
CycleObserver = Callable[[str, DraftBlock | None, StepOutput], None]


class LocalRouter:
    def __init__(self, engine: LocalEngine, proposer: Proposer | None = None, policy: Policy = Policy.NONE,
                 gamma: int = 4, observer: CycleObserver | None = None, sps: list[tuple[int, float]] | None = None,
                 constrained_drafting: bool = True):
        """`sps`: the engine's SPS profile, (batch tokens, step ms) points, which policy dspark plans against
        (verifier_worker/profile.py: `profile_sps`); without one it trims at the planner's λ. The load it
        counts is this router's own requests: in process there is no other. `constrained_drafting`: requests with
        a grammar draft under it where the proposer can (drafter_worker/constrained.py), as served."""
        if policy is not Policy.NONE and proposer is None:
            raise ValueError(f"policy {policy} needs a drafter")
        if policy not in OFFLINE_POLICIES:
            raise ValueError(f"the in-process router serves policies {', '.join(OFFLINE_POLICIES)}, not {policy}")
        # A router lives for one `generate`: its planner starts cold each time, so it explores a few cycles.
        self.planner = VerifyPlanner(explore=EXPLORE_CYCLES)
        if sps:
            self.planner.set_profile("local", sps)
        self.engine, self.proposer, self.policy, self.gamma = engine, proposer, policy, gamma
        self.observer, self.constrained_drafting = observer, constrained_drafting

    def generate(self, requests: list[GenerationRequest], on_tokens: TokenCallback | None = None
                 ) -> list[GenerationResult]:
        """Serve all requests with continuous batching; results in the order of `requests`."""
        queue, sessions = deque(requests), {}
        results: dict[str, GenerationResult] = {}
        called = time.perf_counter()
        while queue or sessions:
            self._admit(queue, sessions, called)
            self._submit_cycles(sessions)
            step_started = time.perf_counter()
            outputs = self.engine.step()
            step_s = time.perf_counter() - step_started
            if not outputs and sessions:
                raise RuntimeError("engine made no progress with requests outstanding")
            for out in outputs:
                session = sessions[out.request_id]
                if session.scheduled is None:
                    session.scheduled = step_started
                if self.proposer is not None:
                    self.proposer.commit(out.request_id, out.feature_start, out.features)
                if out.kind not in (None, OutcomeKind.FIRST):
                    self._observe(session, out, step_s)
                if self.observer is not None and out.kind not in (None, OutcomeKind.FIRST):
                    self.observer(out.request_id, session.block, out)
                new = self._commit(session, out)
                if new and on_tokens:
                    on_tokens(out.request_id, new)
                finish = self._finish_reason(session)
                if finish is not None:
                    results[out.request_id] = self._close(sessions.pop(out.request_id), finish)
        return [results[r.request_id] for r in requests]

    def _admit(self, queue: deque, sessions: dict, called: float) -> None:
        while queue:
            req = queue[0]
            try:
                self.engine.add_request(req.request_id, req.prompt_ids, req.params)
            except CapacityError:
                return  # retried after running requests finish
            queue.popleft()
            constrain = getattr(self.proposer, "constrain", None)
            if req.params.grammar is not None and constrain is not None and self.constrained_drafting:
                grammar = self.engine.grammar_tokenizer().start(req.params.grammar)
                constrain(req.request_id, grammar, len(req.prompt_ids))
            sessions[req.request_id] = _LocalSession(req, called)
            self.planner.join(req.request_id)

    def _submit_cycles(self, sessions: dict[str, _LocalSession]) -> None:
        started = time.perf_counter()
        ready = {rid: s for rid, s in sessions.items() if s.output and not s.in_flight}
        bounds = {rid: max_verify_len(self.policy, self.gamma, s.remaining) for rid, s in ready.items()}
        contexts = {rid: self.engine.tokens(rid) for rid in ready
                    if bounds[rid] > 0 and self.planner.wants_draft(rid, self.policy, 0.0)}
        params = {rid: ready[rid].request.params for rid in contexts}
        blocks = self.proposer.propose(contexts, self.gamma, params) if contexts and self.proposer else {}
        sent = {}
        for rid, session in ready.items():
            block, session.decision = blocks.get(rid), None
            if block is not None:
                session.decision = self.planner.decide(rid, self.policy, "", session.request.params.greedy, block,
                                                       bounds[rid])
                block = block.head(session.decision.verify_len)
                sent[rid] = (contexts[rid], block)
            self.engine.submit(rid, block)
            session.in_flight, session.block, session.cycle_started = True, block, started
        speculate = getattr(self.proposer, "speculate", None)  # a drafter that runs ahead (drafter_worker/ahead.py)
        if speculate is not None and sent:
            speculate(sent, self.gamma, params)

    def _observe(self, session: _LocalSession, out: StepOutput, step_s: float) -> None:
        """What the cycle teaches the planner: its step's time, its whole time, its outcome."""
        self.planner.observe(CycleRecord(out.request_id, self.policy, "", session.request.params.greedy,
                                         session.decision, out.num_drafts, out.num_accepted, step_s,
                                         time.perf_counter() - session.cycle_started,
                                         bool(session.block and session.block.ahead)))

    @staticmethod
    def _commit(session: _LocalSession, out: StepOutput) -> list[int]:
        if out.prompt_logprobs is not None:
            session.prompt_logprobs = session.prompt_logprobs or TokenLogprobs()
            session.prompt_logprobs.extend(out.prompt_logprobs)
        if out.kind is None:
            return []  # a prefill chunk that emits nothing yet
        if out.kind is not OutcomeKind.FIRST:
            session.in_flight = False
            session.cycles += 1
            session.cycle_tokens += len(out.emitted)
            session.draft_tokens += out.num_drafts
            session.accepted_tokens += out.num_accepted
            if len(session.accepted_per_pos) < out.num_drafts:
                session.accepted_per_pos.extend([0] * (out.num_drafts - len(session.accepted_per_pos)))
            for k in range(out.num_accepted):
                session.accepted_per_pos[k] += 1
            if len(session.proposed_per_pos) < out.num_drafts:
                session.proposed_per_pos.extend([0] * (out.num_drafts - len(session.proposed_per_pos)))
            for k in range(out.num_drafts):
                session.proposed_per_pos[k] += 1
            if session.block is not None and session.block.ahead:
                session.ahead_cycles += 1
                session.ahead_accepted += out.num_accepted
        req = session.request
        new = keep(out.emitted, session.output, req.params.max_tokens, req.stop_token_ids)
        session.output.extend(new)
        if out.logprobs is not None:
            session.logprobs = session.logprobs or TokenLogprobs()
            session.logprobs.extend(out.logprobs.head(len(new)))
        return new

    @staticmethod
    def _finish_reason(session: _LocalSession) -> FinishReason | None:
        req = session.request
        return finish_reason(session.output, req.params.max_tokens, req.stop_token_ids)

    def _close(self, session: _LocalSession, finish: FinishReason) -> GenerationResult:
        rid = session.request.request_id
        self.engine.release(rid)
        self.planner.leave(rid)
        if self.proposer is not None:
            self.proposer.release(rid)
        return GenerationResult(
            request_id=rid,
            prompt_ids=session.request.prompt_ids,
            token_ids=session.output,
            finish_reason=finish,
            cycles=session.cycles,
            cycle_tokens=session.cycle_tokens,
            draft_tokens=session.draft_tokens,
            accepted_tokens=session.accepted_tokens,
            accepted_per_pos=session.accepted_per_pos,
            proposed_per_pos=session.proposed_per_pos,
            elapsed_s=time.perf_counter() - session.scheduled,
            queued_s=session.scheduled - session.queued,
            logprobs=session.logprobs,
            prompt_logprobs=session.prompt_logprobs,
            ahead_cycles=session.ahead_cycles,
            ahead_accepted=session.ahead_accepted,
        )

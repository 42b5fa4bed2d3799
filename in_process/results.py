"""What an in-process run is asked (`GenerationRequest`) and what it answers (`GenerationResult`), and the tally
that turns the router's cycles into a result."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from router.session import Chunk
from services.types import DraftBlock, FinishReason, SamplingParams, StepOutput, TokenLogprobs


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    sample_of: str = ""  # one of n samples of a prompt: the id of the sample that prefills it (the API's `n`)


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason
    cycles: int  # verifier steps after prefill: cycles, and each step of a plain run
    cycle_tokens: int  # tokens emitted by cycles, accepted + 1 each (several for a plain run), before any cut
    draft_tokens: int  # Σ ℓ over cycles
    accepted_tokens: int
    accepted_per_pos: list[int]  # [γ] cycles whose draft at position k was accepted
    elapsed_s: float  # from taking a running slot (prefill) to the last token: the request's own speed
    proposed_per_pos: list[int] = field(default_factory=list)  # [γ] cycles that verified a draft at position k
    queued_s: float = 0.0  # from `generate` to taking a running slot: the wait for a slot
    logprobs: TokenLogprobs | None = None  # [len(token_ids)] when params.logprobs is set
    prompt_logprobs: TokenLogprobs | None = None  # prompt tokens 1.. when params.prompt_logprobs is set
    ahead_cycles: int = 0  # cycles verifying a block drafted ahead (drafter_worker/ahead.py)
    ahead_accepted: int = 0  # drafts accepted in them
    pushed_cycles: int = 0  # of the ahead cycles, those whose block the drafter pushed (no draft request)

    @property
    def tau(self) -> float:
        """Acceptance length τ: tokens emitted per cycle, bonus/recovered token included."""
        return self.cycle_tokens / self.cycles if self.cycles else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode speed over the request's own time (queueing excluded: `queued_s`)."""
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0


def _count(per_pos: list[int], n: int) -> None:
    """One more cycle at each of the first n positions."""
    if len(per_pos) < n:
        per_pos.extend([0] * (n - len(per_pos)))
    for k in range(n):
        per_pos[k] += 1


@dataclass(slots=True)
class ResultTally:
    """One request's result as it is served: its chunks and its cycles' outcomes."""

    request: GenerationRequest
    queued: float  # when `generate` was called
    running: float | None = None  # when it took a running slot
    finished: float = 0.0
    output: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    cycles: int = 0
    cycle_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    proposed_per_pos: list[int] = field(default_factory=list)
    ahead_cycles: int = 0
    ahead_accepted: int = 0
    pushed_cycles: int = 0
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None

    def verified(self, block: DraftBlock | None, out: StepOutput, pushed: bool = False) -> None:
        # A reply without drafts may be a plain run's (RouterConfig.plain): one step per token emitted.
        self.cycles += 1 if out.num_drafts else max(1, len(out.emitted))
        self.cycle_tokens += len(out.emitted)
        self.draft_tokens += out.num_drafts
        self.accepted_tokens += out.num_accepted
        _count(self.accepted_per_pos, out.num_accepted)
        _count(self.proposed_per_pos, out.num_drafts)
        if block is not None and block.ahead:
            self.ahead_cycles += 1
            self.ahead_accepted += out.num_accepted
            self.pushed_cycles += pushed

    def chunk(self, chunk: Chunk) -> None:
        self.output.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            self.logprobs = self.logprobs or TokenLogprobs()
            self.logprobs.extend(chunk.logprobs)
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        if chunk.finish_reason is not None:
            self.finish, self.finished = chunk.finish_reason, time.perf_counter()

    def result(self) -> GenerationResult:
        running = self.running if self.running is not None else self.queued
        return GenerationResult(
            request_id=self.request.request_id, prompt_ids=self.request.prompt_ids, token_ids=self.output,
            finish_reason=self.finish, cycles=self.cycles, cycle_tokens=self.cycle_tokens,
            draft_tokens=self.draft_tokens, accepted_tokens=self.accepted_tokens,
            accepted_per_pos=self.accepted_per_pos, proposed_per_pos=self.proposed_per_pos,
            elapsed_s=self.finished - running, queued_s=running - self.queued, logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs, ahead_cycles=self.ahead_cycles, ahead_accepted=self.ahead_accepted,
            pushed_cycles=self.pushed_cycles)

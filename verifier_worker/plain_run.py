"""A plain run: plain decoding before the router asks: a request that will never carry a draft (method `none`) needs
nothing from the router between two steps, so the verifier queues its next step as soon as the last one is
done, up to `depth` steps before the router asks, and a verify call takes every step done since the last
one as one reply, waiting for `interval` of them (fewer at the end). The router's hop (gRPC, its event
loop, the API's stream) then overlaps the engine's next step instead of adding to it, and its per-message
cost — on a machine with few cores, CPU taken from the engine — is shared by the tokens a reply carries
(vLLM's and SGLang's --stream-interval do the same at their APIs).

Lossless by construction: a plain step's output depends on the request's committed tokens and its
generator only, never on when the step was queued. Steps past the router's end (a stop string only the
router sees) are work lost, never output: the router keeps what `keep` allows and releases the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.errors import InvalidRequestError
from services.types import PlainRun, SamplingParams, StepOutput, TokenLogprobs

MAX_DEPTH = 64  # what a PrefillRequest may ask for (protos/dspark/v1/dspark.proto: plain_depth)


def check_plain_run(plain: PlainRun) -> None:
    if not 1 <= plain.depth <= MAX_DEPTH:
        raise InvalidRequestError(f"plain_depth must be in [1, {MAX_DEPTH}], got {plain.depth}")
    if not 1 <= plain.interval <= plain.depth:
        raise InvalidRequestError(f"stream_interval must be in [1, plain_depth = {plain.depth}], got {plain.interval}")


@dataclass(slots=True)
class PlainRunState:
    """One request's plain run: the steps done before the router asked, and whether another may be queued."""

    run: PlainRun  # how deep, and how many steps a reply waits for
    params: SamplingParams
    emitted: int = 0  # tokens emitted since the prefill (the first included)
    ended: bool = False  # a stop token or max_tokens reached: queue nothing more on our own
    done: list[StepOutput] = field(default_factory=list)  # steps the router has not taken yet

    def record(self, out: StepOutput) -> None:
        """A step of this request finished (the prefill's first token, or a plain step)."""
        self.emitted += len(out.emitted)
        last = out.emitted[-1] if out.emitted else None
        if self.emitted >= self.params.max_tokens or last in self.params.stop_token_ids:
            self.ended = True

    def wants_step(self) -> bool:
        return not self.ended and len(self.done) < self.run.depth

    def ready(self) -> bool:
        """A reply is due: `interval` steps done, or some and no more will be queued."""
        return len(self.done) >= self.run.interval or (self.ended and bool(self.done))

    def untaken(self) -> int:
        """Tokens the engine has committed that the router has not been given yet."""
        return sum(len(s.emitted) for s in self.done)

    def take(self) -> StepOutput:
        """Every step done since the last call, as one output (the caller checks that there is one)."""
        steps, self.done = self.done, []
        return merge(steps)


def merge(steps: list[StepOutput]) -> StepOutput:
    """Consecutive plain steps of one request as one: their tokens, features and logprobs in order."""
    if len(steps) == 1:
        return steps[0]
    first, last = steps[0], steps[-1]
    feats = [s.features for s in steps if s.features is not None]
    logprobs = None
    if first.logprobs is not None:
        logprobs = TokenLogprobs()
        for s in steps:
            logprobs.extend(s.logprobs)
    return StepOutput(first.request_id, [t for s in steps for t in s.emitted], kind=last.kind,
                      feature_start=first.feature_start, features=torch.cat(feats) if feats else None,
                      logprobs=logprobs)

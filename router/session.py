"""One request's state in the tiered router: committed tokens, cycle counters, the drafter's delta."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import torch

from router.scheduling.policy import Policy
from router.text_stream import TextStream
from services.batching import ema
from services.calls import DraftCall, OpenCall, Pushed
from services.errors import InvalidRequestError
from services.types import DraftBlock, FinishReason, SamplingParams, TokenLogprobs


@dataclass(frozen=True, slots=True)
class Speculation:
    """How one request is served: which drafter, which verify-length policy, block size γ."""

    method: str = "none"  # none | mtp | eagle3 | dflash | dspark | …
    policy: Policy = Policy.NONE
    gamma: int = 0
    min_tokens_per_s: float = 0.0  # SLA of policy dspark: 0 = none
    ahead: bool = False  # send ahead notices: the drafter drafts the next block while this one is verified


@dataclass(slots=True)
class PrefixShare:
    """The samples of one prompt (n > 1): the leader prefills; each other sample waits for that, then prefills
    beside it on the same verifier replica copying its cached prompt (`share_prefix_of`), and takes the
    prompt's features from it. Only a hint for the verifier: a sample served alone gives the same output."""

    leader: str  # the leader's request id
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    # → the leader's prompt features [P, T·d] (None: no taps, or its prefill failed: prefill in full)


@dataclass(slots=True)
class RouterRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    stop: tuple[str, ...] = ()  # stop strings, excluded from the text
    stop_token_ids: tuple[int, ...] = ()  # the model's EOS unless ignore_eos, plus the request's own
    # Resolved by admission (`router/api/admission.py`); in-process callers may give the raw options
    # {"method", "policy", "gamma", "min_tokens_per_s"}, which `Router.generate` resolves. None: the default.
    speculative: Speculation | dict | None = None
    include_stop: bool = False  # a stop string stays in the text (vLLM's include_stop_str_in_output)
    skip_special: bool = True  # special tokens have no text (vLLM's skip_special_tokens)
    prefix: PrefixShare | None = None  # one of n samples of a prompt

    @property
    def follows(self) -> bool:
        """A sample that copies its leader's prefill."""
        return self.prefix is not None and self.prefix.leader != self.request_id


@dataclass(slots=True)
class Chunk:
    """What one cycle (or the prefill) adds to the output."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cycle: int
    logprobs: TokenLogprobs | None = None  # of token_ids, when the request asks for logprobs
    prompt_logprobs: TokenLogprobs | None = None  # the first chunk's: prompt tokens 1.., when asked for


@dataclass(slots=True)
class DrafterLink:
    """A request's link to its drafter: whether its context is open there, and after a loss when to reopen it
    (at once, then backing off 1, 2, 4, … cycles while reopening fails, up to a bound)."""

    ok: bool = False
    detached_at: int | None = None  # cycle at which the drafter was lost
    reattach_wait: int = 0  # cycles to wait after a loss before reopening
    ahead_sent: bool = False  # the last cycle's block went with an ahead notice to the drafter
    ready: DraftBlock | None = None  # the block the drafter pushed for the last verification's outcome
    pushed: int = 0  # blocks pushed with the last reply (the fan-out a pushed block was chosen from)

    def opened(self) -> None:
        self.ok, self.ready = True, None  # the open call carried the whole context

    def lost(self, cycle: int, max_wait: int) -> None:
        self.ok, self.detached_at, self.ready = False, cycle, None
        self.reattach_wait = min(2 * self.reattach_wait or 1, max_wait)

    def drafted(self) -> None:
        """A block came back: a later loss reopens at once again."""
        self.reattach_wait = 0

    def take(self, pushed: list[Pushed], num_accepted: int, emitted: list[int]) -> None:
        """Hold the pushed block for the outcome a verification reply shows (ℓ accepted, then one token), if any:
        what the next cycle verifies without a draft request. The choice rests on the committed outcome only."""
        self.ready, self.pushed = None, len(pushed)
        if len(emitted) == num_accepted + 1:
            self.ready = next((p.block for p in pushed if (p.accepted, p.token) == (num_accepted, emitted[-1])), None)

    def backing_off(self, cycle: int) -> bool:
        """Lost, and too soon to reopen at `cycle`."""
        return not self.ok and self.detached_at is not None and cycle - self.detached_at < self.reattach_wait


@dataclass(slots=True)
class Session:
    request: RouterRequest
    spec: Speculation
    text: TextStream
    started: float = field(default_factory=time.perf_counter)
    first_token_s: float = 0.0
    output: list[int] = field(default_factory=list)
    vcycle: int = 0  # cycles applied by the current verifier (restarts at 0 after a re-prefill)
    cycle: int = 0  # cycles of this request (drafter messages carry it)
    link: DrafterLink = field(default_factory=DrafterLink)
    skipped_draft: bool = False  # this cycle's plan said drafting does not pay (policy dspark)
    handed_off: bool = False  # decoded by a plain run on the verifier from now on (RouterConfig.plain_handoff)
    # Delta for the drafter since its last message: tokens and features of newly committed positions.
    new_ids: list[int] = field(default_factory=list)
    new_features: list[torch.Tensor] = field(default_factory=list)
    feature_start: int = 0
    features: list[torch.Tensor] = field(default_factory=list)  # all features, for reopening a drafter
    cycle_s: float = 0.0  # EMA of this request's cycle time (the SLA's yardstick)

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output)

    @property
    def committed(self) -> list[int]:
        return [*self.request.prompt_ids, *self.output]

    def observe_cycle(self, seconds: float) -> None:
        self.cycle_s = ema(self.cycle_s, seconds, 0.2)

    def add_features(self, start: int, feats: torch.Tensor | None) -> None:
        if feats is None or not len(feats):
            return
        if not self.new_features:
            self.feature_start = start
        self.new_features.append(feats)
        if self.spec.method != "none":
            self.features.append(feats)

    def open_call(self, traceparent: str) -> OpenCall:
        """(Re)open the drafter's context at the committed tokens; the delta starts anew after them. The context
        includes this cycle's anchor, so the next draft call (this cycle's) is newer than the cycle it names."""
        feats = torch.cat(self.features) if self.features else None
        self.new_ids, self.new_features = [], []
        return OpenCall(self.request.request_id, self.committed, feats, self.params, max(0, self.cycle - 1),
                        self.spec.method, traceparent, len(self.request.prompt_ids))

    def draft_call(self, traceparent: str) -> DraftCall:
        """This cycle's draft call, carrying the delta since the last one (which it empties)."""
        feats = torch.cat(self.new_features) if self.new_features else None
        call = DraftCall(self.request.request_id, self.cycle, self.new_ids, self.feature_start, feats,
                         self.spec.gamma, traceparent)
        self.new_ids, self.new_features = [], []
        return call

    def commit(self, emitted: list[int], logprobs: TokenLogprobs | None = None
               ) -> tuple[list[int], str, TokenLogprobs | None]:
        """Append a cycle's tokens up to max_tokens / a stop token / a stop string → (kept, text delta, their
        logprobs)."""
        self.new_ids.extend(emitted)  # the drafter mirrors the verifier's committed tokens, cuts or not
        kept, text = self.text.feed(keep(emitted, self.output, self.params.max_tokens, self.request.stop_token_ids))
        self.output.extend(kept)
        return kept, text, None if logprobs is None else logprobs.head(len(kept))

    def finish_reason(self) -> FinishReason | None:
        return finish_reason(self.output, self.params.max_tokens, self.request.stop_token_ids, self.text.stopped)


# The commit and finish rules of a request.
def keep(emitted: list[int], output: list[int], max_tokens: int, stop_token_ids: tuple[int, ...]) -> list[int]:
    """The prefix of a cycle's emitted tokens a request keeps: none past max_tokens, none after a stop token."""
    take: list[int] = []
    for token in emitted:
        last = take[-1] if take else (output[-1] if output else None)
        if len(output) + len(take) >= max_tokens or last in stop_token_ids:
            break
        take.append(token)
    return take


def finish_reason(output: list[int], max_tokens: int, stop_token_ids: tuple[int, ...],
                  stopped_by_text: bool = False) -> FinishReason | None:
    """STOP after a stop token (or a stop string), LENGTH at max_tokens, None while the request goes on."""
    if stopped_by_text or (output and output[-1] in stop_token_ids):
        return FinishReason.STOP
    if len(output) >= max_tokens:
        return FinishReason.LENGTH
    return None


def resolve(options: dict | None, default: Speculation, methods: set[str], max_gamma: int) -> Speculation:
    """A request's speculative options within what the deployment allows (InvalidRequestError otherwise)."""
    if not options:
        return default
    unknown = set(options) - {"method", "policy", "gamma", "min_tokens_per_s", "ahead"}
    if unknown:
        raise InvalidRequestError(f"unknown speculative option(s): {', '.join(sorted(unknown))}")
    method = options.get("method") or default.method
    if method != "none" and method not in methods:
        raise InvalidRequestError(f"speculative method {method!r} is not served here (served: none, "
                                  f"{', '.join(sorted(methods))})")
    try:
        policy = Policy(options.get("policy") or (Policy.NONE if method == "none" else default.policy))
    except ValueError:
        raise InvalidRequestError(f"unknown policy {options.get('policy')!r}") from None
    gamma = options.get("gamma") or default.gamma or max_gamma
    if not isinstance(gamma, int) or not 1 <= gamma <= max_gamma:
        raise InvalidRequestError(f"gamma must be an integer in [1, {max_gamma}], got {gamma!r}")
    if (method == "none") != (policy is Policy.NONE):
        raise InvalidRequestError(f"policy {policy} does not go with method {method}")
    sla = options.get("min_tokens_per_s") or 0.0
    if not isinstance(sla, int | float) or not 0 <= sla <= 1e6 or sla != sla:
        raise InvalidRequestError(f"min_tokens_per_s must be a number in [0, 1e6], got {sla!r}")
    ahead = options.get("ahead")
    if ahead is None:
        ahead = default.ahead and method != "none"
    elif not isinstance(ahead, bool) or (ahead and method == "none"):
        raise InvalidRequestError(f"ahead must be true or false, and true only with a drafter, got {ahead!r}")
    return Speculation(method, policy, 1 if policy is Policy.MTP1 else gamma, float(sla), ahead)

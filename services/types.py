"""Typed contracts between stages (docs/design.md §1 vocabulary)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import torch

from services.errors import InvalidRequestError

MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's bound for completions and chat)
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's bound)
MAX_ALLOWED_TOKENS = 4096  # allowed_token_ids entries
MAX_BAD_WORDS = 64  # bad-word token sequences, each of at most MAX_BAD_WORD_TOKENS
MAX_BAD_WORD_TOKENS = 32
MAX_PENALTY = 100.0  # repetition_penalty above this is no sampling any more, only a way to stall a step
MAX_GRAMMAR_CHARS = 65536  # a grammar's text (a JSON schema, a regex, a Lark or GBNF grammar)


class GrammarKind(StrEnum):
    """What a structured-output request constrains the output to (services/grammar.py compiles each)."""

    JSON_SCHEMA = "json_schema"  # a JSON schema (OpenAI response_format json_schema, vLLM json, SGLang json_schema)
    REGEX = "regex"
    CHOICE = "choice"  # a JSON list of strings: exactly one of them
    GRAMMAR = "grammar"  # Lark or GBNF / EBNF (vLLM grammar, SGLang ebnf)


@dataclass(frozen=True, slots=True)
class Grammar:
    kind: GrammarKind
    text: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", GrammarKind(self.kind))
        if not self.text or len(self.text) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(f"a {self.kind} constraint must be 1 to {MAX_GRAMMAR_CHARS} characters")


class OutcomeKind(StrEnum):
    """How the last emitted token of a cycle came about."""

    BONUS = "bonus"  # every verified draft was accepted; extra token from p_{ℓ+1}
    RECOVERED = "recovered"  # resampled from norm(max(0, p_j − q_j)) at the first rejection j
    FIRST = "first"  # sampled after prefill (the first anchor)


class FinishReason(StrEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 64
    # Logits processors (services/processors.py), applied by the verifier to every row it verifies with the
    # context that row has in plain decoding. Defaults are the no-op values.
    repetition_penalty: float = 1.0  # HF rule over prompt + output tokens; 1 = off
    frequency_penalty: float = 0.0  # minus penalty × count of the token in the output
    presence_penalty: float = 0.0  # minus penalty once the token is in the output
    min_p: float = 0.0  # drop tokens below min_p × the top probability (after temperature)
    typical_p: float = 1.0  # locally typical sampling (Hugging Face's typical_p, after top-p); 1 = off
    min_tokens: int = 0  # `stop_token_ids` are masked while fewer output tokens than this exist
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    stop_token_ids: tuple[int, ...] = ()  # what min_tokens masks: the model's EOS (unless ignored) + the request's
    allowed_token_ids: tuple[int, ...] = ()  # only these may be generated; () = every token (vLLM)
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never completed: a sequence's last token is
    # banned wherever the output ends with the rest of it (vLLM's bad_words, tokenized by the router)
    # Structured output: every verified row masked to what the grammar allows after that row's own output
    # (services/grammar.py); None = unconstrained.
    grammar: Grammar | None = None
    # Log-probabilities of the target's raw distribution (log-softmax of the logits, vLLM's raw_logprobs):
    logprobs: int | None = None  # per emitted token, with this many top alternatives; None = none
    prompt_logprobs: int | None = None  # per prompt token after the first, likewise

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        self._check_processors()

    def _check_processors(self) -> None:
        if not (math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= MAX_PENALTY):
            raise InvalidRequestError(f"repetition_penalty must be in (0, {MAX_PENALTY:g}], got "
                                      f"{self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (0.0 < self.typical_p <= 1.0):
            raise InvalidRequestError(f"typical_p must be in (0, 1], got {self.typical_p}")
        if self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
        if not all(math.isfinite(b) and -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise InvalidRequestError("logit_bias values must be in [-100, 100]")
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKENS:
            raise InvalidRequestError(f"allowed_token_ids has {len(self.allowed_token_ids)} entries; at most "
                                      f"{MAX_ALLOWED_TOKENS}")
        if len(self.bad_words) > MAX_BAD_WORDS or not all(0 < len(w) <= MAX_BAD_WORD_TOKENS for w in self.bad_words):
            raise InvalidRequestError(f"bad_words: at most {MAX_BAD_WORDS} non-empty token sequences of at most "
                                      f"{MAX_BAD_WORD_TOKENS} tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class DraftBlock:
    """γ draft tokens from the anchor with their sparse truncated draft distributions q'_k.

    q_ids/q_probs None means q is one-hot at each token (greedy or deterministic drafters such as
    n-gram); otherwise row k is the support of q'_k and its probabilities (summing to 1).
    """

    tokens: list[int]  # [γ]
    q_ids: torch.Tensor | None = None  # [γ, K] int64
    q_probs: torch.Tensor | None = None  # [γ, K] fp32
    confidences: list[float] | None = None  # [γ] c_k, when the drafter has a confidence head
    # [γ] max_v q_k(v) of the draft distribution each token was drawn from (computed from x_<k only,
    # never from x_k): the acceptance signal of drafters without a confidence head
    peaks: list[float] | None = None
    ahead: bool = False  # drafted ahead, during the verification before (a speculation-cache hit)
    fanout: int = 0  # after an ahead notice: blocks pre-drafted for this cycle's likely outcomes (hit or miss)

    def __len__(self) -> int:
        return len(self.tokens)

    def head(self, length: int) -> DraftBlock:
        """The first `length` drafts (the verify length ℓ chosen by the scheduler)."""
        cut = slice(0, length)
        return DraftBlock(
            tokens=self.tokens[cut],
            q_ids=None if self.q_ids is None else self.q_ids[cut],
            q_probs=None if self.q_probs is None else self.q_probs[cut],
            confidences=None if self.confidences is None else self.confidences[cut],
            peaks=None if self.peaks is None else self.peaks[cut],
            ahead=self.ahead,
            fanout=self.fanout,
        )


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities of a run of tokens under the target's raw distribution at the rows that predicted them."""

    logprobs: list[float] = field(default_factory=list)  # [n] of each token
    top_ids: list[list[int]] = field(default_factory=list)  # [n][k] the k most likely tokens, best first
    top_logprobs: list[list[float]] = field(default_factory=list)  # [n][k] their log-probabilities

    def __len__(self) -> int:
        return len(self.logprobs)

    def head(self, n: int) -> TokenLogprobs:
        return TokenLogprobs(self.logprobs[:n], self.top_ids[:n], self.top_logprobs[:n])

    def extend(self, other: TokenLogprobs | None) -> None:
        if other is not None:
            self.logprobs += other.logprobs
            self.top_ids += other.top_ids
            self.top_logprobs += other.top_logprobs


@dataclass(slots=True)
class StepOutput:
    """What one engine step produced for one request."""

    request_id: str
    emitted: list[int]  # tokens newly committed as output: accepted drafts + recovered/bonus (or first)
    num_drafts: int = 0  # ℓ verified this step
    num_accepted: int = 0
    kind: OutcomeKind | None = None  # None for a prefill chunk that emits nothing yet
    feature_start: int = 0  # position of the first row of `features`
    features: torch.Tensor | None = None  # [P, num_taps * d] of the newly committed positions
    logprobs: TokenLogprobs | None = None  # [len(emitted)] when the request asks for logprobs
    prompt_logprobs: TokenLogprobs | None = None  # a prefill chunk's share of the prompt's (tokens 1..)


# Results and loads that cross between the tiers and the router (what `protos/codec.py` encodes).
@dataclass(slots=True)
class Prefilled:
    """A verifier's answer to a prefill: the first token and the target features of the prompt."""


    emitted: list[int]  # [1] the first token; empty when resumed
    committed: int  # committed tokens: prompt + emitted (+ resumed)
    features: torch.Tensor | None  # [committed − 1, T*d] every position before the anchor
    logprobs: TokenLogprobs | None = None  # [len(emitted)] of the first token
    prompt_logprobs: TokenLogprobs | None = None  # [prompt − 1] of prompt tokens 1.. (none for the first)
    feature_start: int = 0  # position of features[0]: > 0 when a sibling's cached prefix was copied


@dataclass(frozen=True, slots=True)
class PlainRun:
    """A request that never carries a draft (method none), so its verifier may decode ahead of the router
    (verifier_worker/plain_run.py): `depth` steps at most before they are asked for, and a reply waits until
    `interval` steps are done (fewer at the request's end; vLLM's stream interval)."""

    depth: int = 8
    interval: int = 4


@dataclass(slots=True)
class Verified:
    output: StepOutput
    committed: int


@dataclass(slots=True)
class VerifierLoad:
    running: int
    waiting: int
    kv_used: int
    kv_total: int
    step_ms_ema: float
    steps: int
    streams: int
    batch_tokens: int  # tokens in the last step


@dataclass(slots=True)
class DrafterLoad:
    contexts: int
    queued: int
    step_ms_ema: float
    steps: int


@dataclass(frozen=True, slots=True)
class VerifierProfile:
    engine_id: str  # the replica's key on the load board
    sps: list[tuple[int, float]] = field(default_factory=list)  # (batch tokens, step ms); empty: not profiled


class Proposer(Protocol):
    """Proposes draft blocks for many requests at once.

    `contexts` maps request id → its committed tokens (the last one is the anchor); `params` gives each
    request's sampling parameters (drafts are sampled at the request's temperature). A drafter may return a
    shorter block than γ (even an empty one) when it has nothing to propose. `commit` hands over the target
    features of newly committed positions (rows from `feature_start` on), which model drafters condition on.
    """

    def propose(self, contexts: dict[str, list[int]], gamma: int,
                params: dict[str, SamplingParams] | None = None) -> dict[str, DraftBlock]: ...

    def commit(self, request_id: str, feature_start: int, features: torch.Tensor | None) -> None: ...

    def release(self, request_id: str) -> None: ...

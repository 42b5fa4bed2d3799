"""The calls the router makes of its tiers, one typed message each (SGLang's io_struct, for dspark's tiers).

A call travels unchanged from the router through the pool (`router/tiers/pooled.py`), the gRPC client and the
codec (`protos/codec.py`), or the in-process adapter, to the tier's service, which answers it: one message per
call instead of seven positional arguments in six places. `traceparent` is the W3C context of the caller's span;
a service never reads it (its server opened the span from it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.types import DraftBlock, PlainRun, SamplingParams


@dataclass(slots=True)
class PrefillCall:
    """Prefill a request on a verifier (or re-prefill it there, from its committed tokens, after a lost one)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    resume_ids: list[int] = field(default_factory=list)  # output committed before a re-prefill; empty at first
    traceparent: str = ""
    share_prefix_of: str = ""  # a sibling sample's id whose cached prompt the replica may copy (a hint)
    plain: PlainRun | None = None  # the request never carries a draft: its verifier may decode ahead of the calls


@dataclass(slots=True)
class VerifyCall:
    """One cycle of a request: verify its draft block (None: a plain step)."""

    request_id: str
    cycle: int  # the verifier's cycle number: one more than its last
    draft: DraftBlock | None
    traceparent: str = ""
    plain: PlainRun | None = None  # a hand-off: from this call on the request runs plainly, with no draft again


@dataclass(slots=True)
class OpenCall:
    """(Re)open a request's draft context on a drafter."""

    request_id: str
    context_ids: list[int]  # [N] the committed tokens
    features: torch.Tensor | None  # [N − 1, T*d] the target's taps of every position before the anchor
    params: SamplingParams
    cycle: int = 0  # the drafter's last cycle: the next draft call carries a higher one
    method: str = ""  # which hosted drafter ("": the replica's default)
    traceparent: str = ""
    output_start: int = 0  # context_ids[output_start:] is the output so far: where a grammar starts reading


@dataclass(slots=True)
class DraftCall:
    """The tokens committed since the last call, with their features; answer with a block of up to γ drafts."""

    request_id: str
    cycle: int
    new_ids: list[int]  # [n] newly committed tokens
    feature_start: int  # position of features[0]
    features: torch.Tensor | None  # [m, T*d] the taps of newly committed positions (m = n when in step)
    gamma: int
    traceparent: str = ""


@dataclass(slots=True)
class AheadCall:
    """The block of `cycle` went to verification cut to `verify_len` drafts: draft ahead of its outcomes, and
    answer with the likeliest of them drafted first (`Pushed`: the router holds them before the verification
    ends, so a hit costs it no draft round trip).

    `taken`: the block in verification is one this drafter pushed the cycle before; the call carries the delta a
    draft call would have (its cycle is this one's), applied first, and names that block as the one sent."""

    request_id: str
    cycle: int
    verify_len: int
    accept: list[float] | None = None  # the router's ĉ_k of each verified draft; None: the drafter's own
    taken: DraftCall | None = None


@dataclass(slots=True)
class Pushed:
    """A block drafted ahead, pushed with the reply to an ahead notice: the next block if the verification of
    the block in flight accepts `accepted` of its drafts, then emits `token`."""

    accepted: int
    token: int
    block: DraftBlock

"""The ahead notice: while a block is verified, tell the drafter which cut of it is being verified.

For requests with `speculative.ahead` (docs/design.md §7.1): the notice carries the verify length and the
acceptance the router has measured for the block's drafts (ĉ_k of §6; the drafter's fan-out across ℓ follows
it), so a replica with a speculation cache drafts the next block for the block's likeliest outcomes meanwhile,
and answers with the first of them (pushed): the router holds them before the verification ends, and a hit
costs it no draft round trip. When the block in verification is itself a pushed one, the notice carries the
delta the skipped draft request would have.
"""

from __future__ import annotations

import asyncio
import logging

from router.scheduling.planner import Decision
from router.session import Session
from router.tiers.protocol import DrafterTier
from services.calls import AheadCall, Pushed
from services.types import DraftBlock

log = logging.getLogger(__name__)


def ahead_notice(drafter: DrafterTier, s: Session, block: DraftBlock | None, decision: Decision | None,
                 held: bool, traceparent: str = "") -> asyncio.Task | None:
    """The notice as a task started beside the verify call (its result: the blocks pushed), or None when the
    request does not draft ahead this cycle. `held`: the block is one the drafter pushed, so no draft request
    carried the delta; the notice does. The caller reads the task after the verification if it is done, and
    does not wait for it otherwise: the next call on the request's stream is answered after it."""
    if not s.spec.ahead or not block:
        return None
    accept = decision.accept[: len(block)] if decision is not None else None  # the block is its first ℓ drafts
    taken = s.draft_call(traceparent) if held else None
    call = AheadCall(s.request.request_id, s.cycle, len(block), accept, taken)
    return asyncio.create_task(_send(drafter, call))


async def _send(drafter: DrafterTier, call: AheadCall) -> list[Pushed]:
    try:
        return await drafter.ahead(call)
    except Exception as error:  # the next draft request finds out whether the drafter is still there
        log.debug("ahead notice for %s not answered: %s", call.request_id, error)
        return []

"""In-process generation: the one cycle loop (`router/router.py: Router`) over a verifier and a drafter tier in this
process, behind a synchronous call for the CLI (`dspark generate`), evaluation, training rollouts and benchmarks.

What runs is what serves: the same sessions, policies (dspark and threshold included), verify planner, plain runs
and hand-off, stop rules and drafting ahead; only the hops are gone. The tiers are the services a replica hosts
(`VerifierService`, `DrafterService`) behind their in-process adapters, each started for one `generate` and
stopped after it. Their models step on the caller's thread (`InlineExecutor`): no thread hop a step, and the
caller's OpenMP team. With a drafter that drafts ahead each tier steps in a compute thread of its own, since
drafting ahead only pays while the verifier steps.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from drafter_worker.service import DrafterService, LocalDrafter
from in_process.results import GenerationRequest, GenerationResult, ResultTally
from router.router import Router, RouterConfig
from router.scheduling.planner import VerifyPlanner
from router.scheduling.policy import Policy
from router.session import PrefixShare, RouterRequest, Speculation
from services.batching import InlineExecutor, compute_thread
from services.types import DraftBlock, Proposer, StepOutput, VerifierProfile
from verifier_worker.engine import Engine
from verifier_worker.service import LocalVerifier, VerifierService

EXPLORE_CYCLES = 8  # whole blocks verified before threshold / dspark trust their estimates (VerifyPlanner)
WINDOW_S = 0.002  # a tier's batch window: every session is in this process, so stragglers are rare
LEASE_S = 1e9  # nothing here goes away between calls: no lease expires during a run
METHOD = "drafter"  # the one drafter this router hosts, by the name its sessions ask for
TokenCallback = Callable[[str, list[int]], None]
# Called once per verified cycle with the block sent (ℓ drafts, confidences) and the verifier's outcome.
CycleObserver = Callable[[str, DraftBlock | None, StepOutput], None]


class InProcessRouter:
    def __init__(self, engine: Engine, proposer: Proposer | None = None, policy: Policy = Policy.NONE,
                 gamma: int = 4, observer: CycleObserver | None = None, sps: list[tuple[int, float]] | None = None,
                 constrained_drafting: bool = True, explore: int = EXPLORE_CYCLES):
        """`sps`: the engine's SPS profile, (batch tokens, step ms) points, which policy dspark plans against
        (verifier_worker/profile.py: `profile_sps`); without one it trims at the planner's λ. The load it counts
        is this router's own requests: in process there is no other. `constrained_drafting`: requests with a
        grammar draft under it where the proposer can (drafter_worker/constrained.py), as served. A proposer
        with a speculation cache (`drafter_worker/ahead.py: RunAhead`) drafts ahead, as a request with
        `speculative.ahead` is served. `explore`: cycles of whole blocks before the planner trusts its estimates
        (a router lives for one `generate`, so its planner starts cold each time)."""
        if policy is not Policy.NONE and proposer is None:
            raise ValueError(f"policy {policy} needs a drafter")
        self.engine, self.proposer, self.observer, self.sps = engine, proposer, observer, sps or []
        self.constrained_drafting, self.explore = constrained_drafting, explore
        self.ahead = proposer is not None and hasattr(proposer, "speculation")
        method = "none" if policy is Policy.NONE else METHOD
        self.spec = Speculation(method, policy, 1 if policy is Policy.MTP1 else gamma, 0.0, self.ahead)

    def generate(self, requests: list[GenerationRequest], on_tokens: TokenCallback | None = None
                 ) -> list[GenerationResult]:
        """Serve all requests side by side (continuous batching in the tiers); results in the order of `requests`.
        From a thread that runs an event loop, the run gets a thread of its own."""
        prompts = {r.request_id: r.prompt_ids for r in requests}
        if any(r.sample_of and prompts.get(r.sample_of) != r.prompt_ids for r in requests):
            raise ValueError("a sample's `sample_of` must name a request of this run with the same prompt")
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self._generate(requests, on_tokens))
        box: dict = {}

        def run() -> None:
            try:
                box["results"] = asyncio.run(self._generate(requests, on_tokens))
            except BaseException as error:
                box["error"] = error

        thread = threading.Thread(target=run, name="dspark-in-process")
        thread.start()
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["results"]

    async def _generate(self, requests: list[GenerationRequest], on_tokens: TokenCallback | None
                        ) -> list[GenerationResult]:
        called = time.perf_counter()
        tallies = {r.request_id: ResultTally(r, called) for r in requests}
        verifier = VerifierService(self.engine, lease_s=LEASE_S, batch_window_s=WINDOW_S)
        drafter = self._drafter(requests)
        # Drafting ahead overlaps a verify step only while that step runs off the event loop: then each tier steps
        # in a thread of its own, as each steps in its own process when served.
        await verifier.start(compute_thread() if self.ahead else InlineExecutor())
        if drafter is not None:
            await drafter.start(compute_thread() if self.ahead else InlineExecutor())
        router = self._router(verifier, drafter, tallies, len(requests))
        shares = {r.sample_of: PrefixShare(r.sample_of) for r in requests if r.sample_of}
        try:
            results = await asyncio.gather(*(self._one(router, tallies[r.request_id], on_tokens,
                                                       shares.get(r.sample_of or r.request_id)) for r in requests))
        finally:
            await verifier.stop()
            if drafter is not None:
                await drafter.stop()
        return results

    def _drafter(self, requests: list[GenerationRequest]) -> DrafterService | None:
        if self.spec.method == "none":
            return None
        constrained = self.constrained_drafting and any(r.params.grammar is not None for r in requests)
        return DrafterService({METHOD: self.proposer}, {METHOD: self.spec.gamma}, WINDOW_S, lease_s=LEASE_S,
                              grammar=self.engine.grammar_tokenizer() if constrained else None)

    def _router(self, verifier: VerifierService, drafter: DrafterService | None, tallies: dict[str, ResultTally],
                requests: int) -> Router:
        planner = VerifyPlanner(explore=self.explore)
        if self.sps:
            planner.set_profile("local", self.sps)
        config = RouterConfig(default=self.spec, max_gamma=max(16, self.spec.gamma),
                              max_running=max(1, min(requests, self._slots())), max_queue=requests)
        return Router(LocalVerifier(verifier, VerifierProfile("local", self.sps)),
                      None if drafter is None else LocalDrafter(drafter), {METHOD}, config,
                      planner=planner, observer=_Observer(tallies, self.observer))

    def _slots(self) -> int:
        """Requests that may run at once: the engine's KV slots (the rest wait for one, as served)."""
        config = getattr(self.engine, "config", None)
        return getattr(config, "num_slots", None) or 1 << 30

    @staticmethod
    async def _one(router: Router, tally: ResultTally, on_tokens: TokenCallback | None,
                   share: PrefixShare | None) -> GenerationResult:
        """`share`: the samples of one prompt copy their leader's prefill (`GenerationRequest.sample_of`)."""
        req = tally.request
        served = RouterRequest(req.prompt_ids, req.params, req.request_id, stop_token_ids=req.stop_token_ids,
                               prefix=share)
        async for chunk in router.generate(served):
            tally.chunk(chunk)
            if chunk.token_ids and on_tokens is not None:
                on_tokens(req.request_id, chunk.token_ids)
        return tally.result()


class _Observer:
    """The router's view of each request, into its tally (and the caller's cycle observer)."""

    def __init__(self, tallies: dict[str, ResultTally], cycles: CycleObserver | None):
        self.tallies, self.cycles = tallies, cycles

    def running(self, request_id: str) -> None:
        self.tallies[request_id].running = time.perf_counter()

    def verified(self, request_id: str, block: DraftBlock | None, output: StepOutput, pushed: bool) -> None:
        self.tallies[request_id].verified(block, output, pushed)
        if self.cycles is not None:
            self.cycles(request_id, block, output)

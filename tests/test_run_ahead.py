"""The drafter running ahead (speculation cache): outcome rules, exactness with the cache on, hits counted."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from drafter_worker.ahead import RunAhead
from drafter_worker.ahead_window import AheadWindow
from drafter_worker.drafter import Drafter, _knobs
from drafter_worker.service import DrafterService
from drafter_worker.speculation import Outcome, PredraftCache, Predrafted, Steering, likely_outcomes, outcome_of
from in_process.generation import GenerationRequest, InProcessRouter
from router.scheduling.policy import Policy
from services.calls import AheadCall, DraftCall, OpenCall
from services.types import DraftBlock, SamplingParams
from tests.chi2 import token_p_value
from tests.conftest import make_engine, make_model, random_prompts
from tests.drafters import RandomProposer
from tests.test_drafters import TAPS, draft_model
from tests.test_engine_distribution import PARAMS, PROMPT, VOCAB, _marginals


def test_the_outcome_is_read_from_the_committed_tokens():
    spec = Predrafted(base=3, drafts=[7, 8, 9], blocks={})
    assert outcome_of(spec, [1, 2, 3, 7, 8, 4]) == Outcome(2, 4)  # x1, x2 accepted, 4 recovered
    assert outcome_of(spec, [1, 2, 3, 5]) == Outcome(0, 5)
    assert outcome_of(spec, [1, 2, 3, 7, 8, 9, 6]) == Outcome(3, 6)  # all accepted, 6 the bonus
    assert outcome_of(spec, [1, 2, 3, 7, 5, 4]) is None  # not what the block drafted: no outcome of it
    assert outcome_of(spec, [1, 2, 3]) is None


def test_likely_outcomes_weigh_positions_by_survival_and_drop_the_rejected_draft():
    probs = torch.tensor([[0.6, 0.3, 0.1, 0.0], [0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 0.5, 0.5]])  # positions 1..3
    # a_1 = 0.5, a_2 = 0.9: P(ℓ=0) = 0.5, P(ℓ=1) = 0.05, P(ℓ=2) = 0.45
    best = likely_outcomes([0, 3], [0.5, 0.9], probs, budget=4)
    assert best[0] == Outcome(0, 1)  # 0.5 · 0.3/0.4: the rejected draft 0 is not a recovered token
    assert Outcome(0, 0) not in likely_outcomes([0, 3], [0.5, 0.9], probs, budget=12)
    assert set(best[1:3]) == {Outcome(2, 2), Outcome(2, 3)}  # the bonus keeps its own distribution: 0.225 each
    assert best[3] == Outcome(0, 2)  # 0.5 · 0.1/0.4 = 0.125 beats every ℓ = 1 outcome (≤ 0.05 · 0.5)


def test_the_cache_is_consumed_by_the_next_request():
    cache = PredraftCache()
    block = DraftBlock(tokens=[4, 4], ahead=True)
    cache.store("r", Predrafted(2, [9], {Outcome(0, 5): block}))
    assert cache.fanout("r") == 1 and cache.fanout("other") == 0
    assert cache.take("r", [1, 2, 5]) is block and cache.stats.hits == 1 and cache.fanout("r") == 0
    assert cache.take("r", [1, 2, 5]) is None and cache.stats.misses == 0  # nothing stored: not a miss
    cache.store("r", Predrafted(2, [9], {Outcome(0, 5): block}))
    assert cache.take("r", [1, 2, 9, 3]) is None and cache.stats.misses == 1
    assert cache.stats.fanout == 2


@pytest.fixture(scope="module")
def target():
    """A vocabulary of 12: a random drafter's 8 candidates per position (`likely_outcomes`) then cover most of
    it, so about half the cycles hit; at 96 ids about 6 % did, and CI once saw no hit in 101 cycles."""
    return make_model(vocab=AHEAD_VOCAB, layers=3, taps=TAPS)


AHEAD_VOCAB = 12


def _requests(temperature: float = 0.0) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", p, SamplingParams(temperature=temperature, max_tokens=28 - 2 * i, seed=i))
            for i, p in enumerate(random_prompts(5, vocab=AHEAD_VOCAB))]


class SlowSteps:
    """An engine whose steps cost `seconds` more, off the CPU: a target whose step outlasts a piece of drafting
    ahead, the regime drafting ahead is for (the toy targets step in about the time the drafter drafts)."""

    def __init__(self, engine, seconds: float):
        self.engine, self.seconds = engine, seconds

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        time.sleep(self.seconds)
        return self.engine.step()


class _WidePush(RunAhead):
    """Eight outcomes per request in the first piece, the one pushed with the notice's reply (two by default): at
    two, about 4 of some 100 cycles verified a pushed block, too few to be sure of one in every run."""

    def speculation(self, sent, gamma, params=None, chunk=8):
        return super().speculation(sent, gamma, params, chunk)


@pytest.mark.parametrize("method", ["dspark", "dflash", "eagle3", "mtp"])
def test_greedy_with_the_drafter_ahead_equals_plain(target, method, monkeypatch):
    """Each speculation drafts at least its first piece (`probe_every=1`): on a loaded machine a piece can outlast
    the window, and the window then drafts ahead only every 16th cycle."""
    monkeypatch.setattr("drafter_worker.service.AheadWindow", lambda: AheadWindow(probe_every=1))
    plain = InProcessRouter(make_engine(target), policy=Policy.NONE).generate(_requests())
    ahead = _WidePush(Drafter(draft_model(target, method, mask=AHEAD_VOCAB - 1)), budget=48)
    gamma = 1 if method == "mtp" else 4
    engine = SlowSteps(make_engine(target, num_slots=3, max_batch_tokens=10), 0.03)
    spec = InProcessRouter(engine, ahead, Policy.FIXED, gamma).generate(_requests())
    for s, p in zip(spec, plain, strict=True):
        assert s.token_ids == p.token_ids, f"{method} ahead diverged on {s.request_id}"
    stats = ahead.cache.stats
    assert stats.hits > 0 and stats.misses > 0 and stats.fanout > 0
    assert sum(r.ahead_cycles for r in spec) == stats.hits  # every hit was verified as a block drafted ahead
    assert sum(r.pushed_cycles for r in spec) > 0  # some of them pushed: the router sent no draft request


@pytest.mark.slow
@pytest.mark.parametrize("ahead,steering", [(False, None), (True, None), (True, Steering(2, 0.3))],
                         ids=["lock-step", "plain", "steered"])
def test_sampling_with_the_drafter_ahead_keeps_the_target_distribution(ahead, steering, monkeypatch):
    """χ² of the 2nd and 3rd tokens with cached blocks verified against the q they were drawn from (with
    Saguaro sampling: the steered q'); lock-step, the DSpark drafter's own sampled block (the one-call Markov
    kernel), whose q' once repeated an id past a small draft vocabulary and failed here at p ≈ 1e-83.
    Each speculation drafts at least its first piece (`probe_every=1`): where a piece for 64 requests outlasts
    the 30 ms step, the window would draft ahead only every 16th cycle (CI once saw 49 hits of 1,012 cycles).
    How many hits there are still depends on the machine's speed (87 to 207 in runs on an AVX2 EPYC)."""
    monkeypatch.setattr("drafter_worker.service.AheadWindow", lambda: AheadWindow(probe_every=1))
    model = make_model(vocab=VOCAB, layers=1, hidden=32, seed=5, taps=(0,))
    torch.manual_seed(0)
    drafter = Drafter(draft_model_for(model))
    proposer = RunAhead(drafter, budget=8, steering=steering) if ahead else drafter
    n = 2500
    requests = [GenerationRequest(f"r{i}", PROMPT, SamplingParams(max_tokens=4, seed=i, **PARAMS)) for i in range(n)]
    engine = make_engine(model, num_slots=64, max_len=16, max_batch_tokens=512, max_waiting=4096)
    router = InProcessRouter(SlowSteps(engine, 0.03) if ahead else engine, proposer, Policy.FIXED, gamma=1)
    results = router.generate(requests)
    assert sum(r.accepted_tokens for r in results) > 0 and sum(r.draft_tokens - r.accepted_tokens for r in results) > 0
    assert not ahead or proposer.cache.stats.hits > 20  # blocks drafted ahead were verified
    p2, p3 = _marginals(model)
    assert token_p_value(p2, [r.token_ids[1] for r in results]) > 1e-3
    assert token_p_value(p3, [r.token_ids[2] for r in results]) > 1e-3


def draft_model_for(model):
    from drafter_worker.checkpoint import build_draft_model
    from drafter_worker.config import default_config

    cfg = default_config("dspark", "tiny", (0,), VOCAB - 1, "markov")
    drafter = build_draft_model(cfg, model)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad and p.dim() >= 2:
                p.normal_(0.0, 0.2)
    return drafter.eval()


def test_the_ahead_option_is_resolved_per_request():
    from router.session import Speculation, resolve
    from services.errors import InvalidRequestError

    default = Speculation("dspark", Policy.FIXED, 7, ahead=True)
    assert resolve({"method": "eagle3"}, default, {"dspark", "eagle3"}, 16).ahead  # the deployment's default
    assert not resolve({"ahead": False}, default, {"dspark"}, 16).ahead
    assert not resolve({"method": "none"}, default, {"dspark"}, 16).ahead  # nothing to draft ahead
    for bad in ({"ahead": "yes"}, {"ahead": 1}, {"method": "none", "ahead": True}):
        with pytest.raises(InvalidRequestError, match="ahead"):
            resolve(bad, default, {"dspark"}, 16)


class _Recording(RandomProposer):
    """Records the acceptance estimates each ahead notice hands the speculation (it drafts nothing)."""

    def __init__(self):
        super().__init__(96)
        self.seen: list[list[float] | None] = []

    def speculation(self, sent, gamma, params):
        self.seen.extend(block.confidences for _, block in sent.values())
        return iter(())


def test_the_fan_out_follows_the_acceptance_the_router_sends():
    async def run():
        proposer = _Recording()
        service = DrafterService({"random": proposer}, {"random": 4})
        await service.start()
        await service.open(OpenCall("r", [1, 2, 3], torch.zeros(2, 4), SamplingParams()))
        await service.draft(DraftCall("r", 1, [7], 2, torch.zeros(1, 4), 3))
        await service.ahead(AheadCall("r", 1, 2, [0.9, 0.4]))  # the router's ĉ_k of the two verified drafts
        await asyncio.sleep(0.2)
        await service.draft(DraftCall("r", 2, [5], 3, torch.zeros(1, 4), 3))
        await service.ahead(AheadCall("r", 2, 3))  # none sent: the block's own estimate (this proposer has none)
        await asyncio.sleep(0.2)
        await service.stop()
        return proposer.seen

    assert asyncio.run(run()) == [[0.9, 0.4], None]


class _Pushing(RandomProposer):
    """A proposer whose speculation drafts one piece, a block for the outcome (0 accepted, then 5), which its cache
    then answers."""

    def __init__(self):
        super().__init__(96)

    def speculation(self, sent, gamma, params):
        yield {rid: {Outcome(0, 5): DraftBlock(tokens=[5, 6, 7], ahead=True)} for rid in sent}

    def cached(self, request_id, tokens, gamma):
        return DraftBlock(tokens=[5, 6, 7][:gamma], ahead=True) if tokens[-1] == 5 else None


def test_a_notice_is_answered_with_the_blocks_pushed_and_a_taken_one_brings_its_delta():
    async def run():
        service = DrafterService({"random": _Pushing()}, {"random": 3})
        await service.start()
        await service.open(OpenCall("r", [1, 2, 3], torch.zeros(2, 4), SamplingParams()))
        await service.draft(DraftCall("r", 1, [7], 2, torch.zeros(1, 4), 3))
        first = await service.ahead(AheadCall("r", 1, 2))
        # the router verified the pushed block: the notice of cycle 2 carries cycle 1's outcome as its delta
        second = await service.ahead(AheadCall("r", 2, 3, taken=DraftCall("r", 2, [5], 3, torch.zeros(1, 4), 0)))
        stale = await service.ahead(AheadCall("r", 2, 3, taken=DraftCall("r", 2, [5], 4, torch.zeros(1, 4), 0)))
        session = service._sessions["r"]
        state = (list(session.tokens), session.features, session.cycle)
        block = await service.draft(DraftCall("r", 3, [6, 8], 4, torch.zeros(2, 4), 3))  # the delta after cycle 2
        await service.stop()
        return first, second, stale, state, block

    first, second, stale, state, block = asyncio.run(run())
    assert [(p.accepted, p.token, p.block.tokens) for p in first] == [(0, 5, [5, 6, 7])]
    assert [(p.accepted, p.token) for p in second] == [(0, 5)]  # it drafted ahead of the block it pushed
    assert stale == []  # a cycle already applied changes nothing
    assert state == ([1, 2, 3, 7, 5], 4, 2) and len(block) == 3


def test_steering_scales_the_top_tokens_of_the_rows_that_draft_ahead():
    q = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]])
    out = Steering(top=1, factor=0.5).apply(q, torch.tensor([True, False]))
    assert torch.allclose(out[0], torch.tensor([0.25, 0.3, 0.2]) / 0.75) and torch.equal(out[1], q[1])
    with pytest.raises(ValueError):
        Steering(top=0, factor=0.5)


def test_steered_drafts_report_the_q_they_were_drawn_from():
    """A request that drafts ahead gets drafts from q' (top token scaled down); the block carries q'."""
    model = make_model(vocab=VOCAB, layers=1, hidden=32, seed=5, taps=(0,))
    drafter = Drafter(draft_model_for(model))
    drafter.steering, drafter.steered = Steering(1, 0.25), {"s"}
    logits = torch.randn(1, VOCAB).expand(2, -1)  # the same distribution in both rows
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)]
    _, draft = drafter._sample(logits, params, [True, False], _knobs(params, logits.device))
    (_, (_, steered), _), (_, (_, plain), _) = draft
    assert steered[0] < plain[0] and torch.allclose(steered.sum(), torch.tensor(1.0))
    assert torch.allclose(steered[1:] / steered[1:].sum(), plain[1:] / plain[1:].sum())


def test_drafting_ahead_starts_a_piece_only_while_it_fits_in_the_verify_window():
    window = AheadWindow(probe_every=4)
    assert window.fits(0.0, 0, now=5.0)  # nothing measured: draft and measure
    window.observe_window(0.010)  # verification: 10 ms from the notice to the next draft request
    window.observe_piece(0.004)  # a piece: 4 ms
    assert window.fits(0.0, 1, now=0.004) and not window.fits(0.0, 2, now=0.008)  # 8 + 4 > 10 ms
    window.observe_piece(0.100)  # pieces got dear (a busy machine): no piece fits, a probe now and then
    probes = [window.fits(window.start(0.0), 0, now=0.0) for _ in range(8)]
    assert probes == [False, False, False, True] * 2


class _Cached(RandomProposer):
    """A proposer whose speculation cache holds what the test puts in `answers`."""

    def __init__(self):
        super().__init__(96)
        self.answers: dict[str, DraftBlock] = {}

    def cached(self, request_id, tokens, gamma):
        block = self.answers.pop(request_id, None)
        return None if block is None else block.head(gamma)

    def speculation(self, sent, gamma, params):
        return iter(())


def test_a_hit_is_answered_at_once_and_a_saturated_miss_falls_back_to_no_drafts():
    async def run():
        proposer = _Cached()
        service = DrafterService({"random": proposer}, {"random": 4}, fallback_queue=1)
        await service.start()
        await service.open(OpenCall("r", [1, 2, 3], torch.zeros(2, 4), SamplingParams()))
        await service.draft(DraftCall("r", 1, [7], 2, torch.zeros(1, 4), 3))
        await service.ahead(AheadCall("r", 1, 2))
        proposer.answers["r"] = DraftBlock(tokens=[5, 6, 7, 8], ahead=True)
        hit = await service.draft(DraftCall("r", 2, [4], 3, torch.zeros(1, 4), 3))
        await service.ahead(AheadCall("r", 2, 3))  # after the hit: the cut of the cached block goes to verification
        await service.stop()
        return hit, service

    hit, service = asyncio.run(run())
    assert hit.tokens == [5, 6, 7] and hit.ahead  # cut to γ, without a drafter step
    session = service._sessions["r"]
    service._queue = [object()]  # one draft request waits: saturated for fallback_queue = 1
    assert service._without_drafting(session, "r", 3, noticed=True) == DraftBlock(tokens=[])
    assert service.fallbacks == 1
    assert service._without_drafting(session, "r", 3, noticed=False) is None  # no notice: draft as usual

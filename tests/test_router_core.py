"""Router-core pieces without tiers: stop strings, speculative options, the threshold policy, drafter deltas."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter_worker.service import DrafterService
from router.scheduling.planner import CycleRecord, VerifyPlanner
from router.scheduling.policy import Policy
from router.session import Speculation, resolve
from router.text_stream import TextStream
from services.calls import DraftCall, OpenCall
from services.errors import InvalidRequestError, StaleCycleError
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from services.types import DraftBlock, SamplingParams
from tests.drafters import RandomProposer


@pytest.fixture(scope="module")
def tok():
    return TextTokenizer.from_dir(resolve_model("dspark-target"))


def test_stop_string_cuts_text_and_later_tokens(tok):
    ids = tok.encode("hello world. Goodbye")[1:]  # without BOS
    stream = TextStream(tok, stop=("world",))
    texts, kept = [], []
    for i in range(0, len(ids), 2):
        k, t = stream.feed(ids[i : i + 2])
        kept += k
        texts.append(t)
    texts.append(stream.flush())
    assert stream.stopped and "".join(texts) == "hello " and len(kept) < len(ids)
    assert "world" in tok.decode(kept)  # tokens run up to the one completing the stop string


def test_stop_strings_count_from_min_tokens_and_can_stay_in_the_text(tok):
    ids = tok.encode("a.b.c.d")[1:]
    first_dot = next(i for i in range(len(ids)) if "." in tok.decode(ids[: i + 1]))
    late = TextStream(tok, stop=(".",), min_tokens=first_dot + 2)  # the first "." comes too early to stop
    kept = [t for i in range(len(ids)) for t in late.feed(ids[i : i + 1])[0]]
    assert late.stopped and tok.decode(kept).count(".") == 2 and late.text.count(".") == 1
    kept_stop = TextStream(tok, stop=(".b",), include_stop=True)
    kept_stop.feed(ids)
    assert kept_stop.text == "a.b"


def test_special_tokens_have_text_only_when_asked(tok):
    ids = [tok.bos_token_id, *tok.encode("hi")[1:]]
    plain, raw = TextStream(tok), TextStream(tok, skip_special=False)
    assert plain.feed(ids)[1] + plain.flush() == "hi"
    assert (raw.feed(ids)[1] + raw.flush()).endswith("hi") and len(raw.text) > 2


def test_text_that_could_start_a_stop_string_is_held_back(tok):
    ids = tok.encode("abc STO")[1:]
    stream = TextStream(tok, stop=("STOP",))
    _, text = stream.feed(ids)
    assert text == "abc " and stream.flush() == "STO"


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="ab €😀中\n\t", max_size=40), st.lists(st.integers(1, 5), min_size=1, max_size=8))
def test_streamed_text_is_the_decoded_text(tok, text, cuts):
    """Windowed decoding, streamed in any chunking, adds up to one decode of the whole output, and a character
    split across tokens waits for its last byte instead of streaming as U+FFFD."""
    ids = tok.encode("x " + text)[1:]
    stream, pieces, i, k = TextStream(tok), [], 0, 0
    while i < len(ids):
        pieces.append(stream.feed(ids[i : i + cuts[k % len(cuts)]])[1])
        i, k = i + cuts[k % len(cuts)], k + 1
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) + stream.flush() == tok.decode(ids)


def test_speculative_options_within_the_deployment():
    default = Speculation("dspark", Policy.FIXED, 7)
    methods = {"dspark", "mtp"}
    assert resolve(None, default, methods, 16) == default
    assert resolve({"method": "mtp", "policy": "mtp1"}, default, methods, 16) == Speculation("mtp", Policy.MTP1, 1)
    assert resolve({"method": "none"}, default, methods, 16) == Speculation("none", Policy.NONE, 7)
    for bad in ({"method": "eagle3"}, {"gamma": 17}, {"policy": "magic"}, {"method": "none", "policy": "fixed"},
                {"colour": 1}):
        with pytest.raises(InvalidRequestError):
            resolve(bad, default, methods, 16)


def test_speculative_sla_option():
    default = Speculation("dspark", Policy.DSPARK, 7)
    assert resolve({"min_tokens_per_s": 40}, default, {"dspark"}, 16) == Speculation("dspark", Policy.DSPARK, 7, 40.0)
    for bad in (-1, "fast", float("nan")):
        with pytest.raises(InvalidRequestError):
            resolve({"min_tokens_per_s": bad}, default, {"dspark"}, 16)


def test_threshold_policy_reads_only_the_estimates_of_the_prefix():
    planner = VerifyPlanner(threshold=0.5)  # no outcomes yet: the estimates are the signals themselves

    def ell(policy, block, needed=0.0):
        return planner.decide("r", policy, "dspark", True, block, len(block), needed).verify_len

    block = DraftBlock(tokens=[5, 6, 7, 8], confidences=[0.9, 0.8, 0.3, 0.9])
    assert ell(Policy.THRESHOLD, block) == 2  # a_3 = 0.216 < 0.5
    assert ell(Policy.FIXED, block) == 4
    # Changing the tokens (and anything after the cut) leaves ℓ unchanged: non-anticipating.
    assert ell(Policy.THRESHOLD, DraftBlock(tokens=[1, 2, 3, 4], confidences=[0.9, 0.8, 0.3, 0.0])) == 2
    # Without a head the draft peaks are the signal; without either, ĉ = ½ per position.
    assert ell(Policy.THRESHOLD, DraftBlock(tokens=[1, 2, 3], peaks=[0.95, 0.9, 0.2])) == 2
    assert ell(Policy.THRESHOLD, DraftBlock(tokens=[1, 2])) == 1
    # An SLA of 2.5 tokens per cycle lengthens ℓ until 1 + Σ a_j reaches it: 1 + 0.9 + 0.72 ≥ 2.5 at ℓ = 2,
    # and 3.0 needs ℓ = 4 (never more than the block).
    assert ell(Policy.THRESHOLD, block, 2.5) == 2 and ell(Policy.THRESHOLD, block, 3.0) == 4


def test_a_cold_planner_explores_whole_blocks_before_it_trims():
    """`explore`: threshold and dspark verify whole blocks until that many cycles verified drafts, then trim."""
    planner = VerifyPlanner(threshold=0.5, explore=2)
    block = DraftBlock(tokens=[5, 6, 7, 8], confidences=[0.2, 0.9, 0.9, 0.9])  # a_1 = 0.2 < λ
    for _ in range(2):
        decision = planner.decide("r", Policy.THRESHOLD, "dspark", True, block, len(block))
        assert decision.verify_len == 4 and planner.wants_draft("r", Policy.DSPARK, 0.0)
        planner.observe(CycleRecord("r", Policy.THRESHOLD, "dspark", True, decision, 4, 0, 0.01, 0.02))
    assert planner.decide("r", Policy.THRESHOLD, "dspark", True, block, len(block)).verify_len == 0


def test_the_drafter_lease_frees_contexts_no_stream_carries():
    """A context opened but never drafted on (its router went away) is freed after the lease; one a stream
    carries is kept however long the stream idles, and gets the lease again once the stream ends."""
    async def run():
        service = DrafterService({"random": RandomProposer(96)}, {"random": 4}, lease_s=0.2)
        await service.start()
        for rid in ("orphan", "carried"):
            await service.open(OpenCall(rid, [1, 2, 3], torch.zeros(2, 4), SamplingParams()))
        service.attach("carried")
        await asyncio.sleep(0.5)
        after_lease = sorted(service._sessions)
        service.detach("carried")
        await asyncio.sleep(0.5)
        contexts = service.load().contexts
        await service.stop()
        return after_lease, contexts

    after_lease, contexts = asyncio.run(run())
    assert after_lease == ["carried"] and contexts == 0


def test_drafter_service_rejects_stale_cycles_and_gaps_in_features():
    async def run():
        service = DrafterService({"random": RandomProposer(96)}, {"random": 4})
        await service.start()
        await service.open(OpenCall("r", [1, 2, 3], torch.zeros(2, 4), SamplingParams()))
        block = await service.draft(DraftCall("r", 1, [7, 8], 2, torch.zeros(2, 4), 3))
        errors = []
        for args in ((1, [9], 4, torch.zeros(1, 4), 3), (2, [9], 5, torch.zeros(1, 4), 3), (2, [9], 4, None, 3)):
            with pytest.raises((StaleCycleError, InvalidRequestError)) as info:
                await service.draft(DraftCall("r", *args))
            errors.append(info.type)
        ok = await service.draft(DraftCall("r", 3, [9], 4, torch.zeros(1, 4), 2))  # gaps in cycle numbers are fine
        await service.stop()
        return block, errors, ok

    block, errors, ok = asyncio.run(run())
    assert len(block) == 3 and len(ok) == 2
    assert errors == [StaleCycleError, InvalidRequestError, InvalidRequestError]

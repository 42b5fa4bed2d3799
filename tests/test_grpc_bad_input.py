"""Malformed messages to the gRPC services (real tier processes over loopback), as hypothesis properties.

Each campaign turns valid messages aimed at a request the test holds into malformed ones, one fault each.
Every one must end its call with INVALID_ARGUMENT, or FAILED_PRECONDITION for a stale cycle or an unknown
request, and change nothing: Load reads the same after each, and after the campaign every worker is alive
and SERVING, the held request goes on exactly as plain greedy decoding does, and once the test has released
its requests no KV slot or draft context is left.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from protos.dspark.v1 import dspark_pb2 as pb
from protos.dspark.v1 import dspark_pb2_grpc as rpc
from protos.serving import OPTIONS, GrpcServer
from protos.validate import MAX_FEATURE, MAX_GAMMA, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MIN_TEMPERATURE
from router.grpc_server import RouterServicer
from router.grpc_tiers import GrpcDrafter, GrpcVerifier
from router.launcher import start_tiers
from router.policy import Policy
from router.router import Router, RouterConfig
from router.session import Speculation
from services.model_config import ModelConfig
from services.registry import resolve_model
from services.tokenizer import TextTokenizer
from tests.tiers import PROMPTS, TARGET, drafter_settings, plain_greedy, verifier_settings

IA, FP, OK = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OK
METHODS = {"dspark", "eagle3"}  # one block drafter, one chain drafter
MAX_TOKENS, TIMEOUT_S, U32 = 8, 30.0, 2**32 - 1
NAN, INF = float("nan"), float("inf")
BAD_FLOAT = st.sampled_from([NAN, INF, -INF, 1e30, -3e38])
BAD_TEMPERATURE = (BAD_FLOAT | st.floats(max_value=-1e-300) | st.floats(100.001, 1e300)
                   | st.floats(5e-324, MIN_TEMPERATURE, exclude_max=True))
BAD_TOP_P = st.just(NAN) | st.floats(max_value=-1e-300) | st.floats(min_value=1.0, exclude_min=True)
BAD_ENUM = st.integers(4, 2**31 - 1) | st.integers(-(2**31), -1)
HELD = ["held", "held-g", "held-s", "held-r", "held-d", "twin-d", "full-d"]  # request ids the tests hold
OTHER_ID = st.text(min_size=1, max_size=24).map(lambda s: "x-" + s)  # never held


@dataclass(frozen=True)
class Limits:
    """What the campaigns need to know about the deployment, and the reference outputs."""

    vocab: int
    max_len: int  # verifier positions per request
    width: int  # feature columns: taps × hidden
    positions: int  # the drafters' position table (the target's max context)
    prompts: list[list[int]]
    greedy: list[list[int]]  # plain greedy output of each prompt
    context: list[int]  # committed tokens of prompt 0 after its prefill
    features: pb.Tensor  # their target features (fp32)

    def out_of_vocab(self, draw) -> int:
        return draw(st.integers(self.vocab, U32))


class Tier:
    def __init__(self, process, stub, service: str):
        self.process, self.service = process, service
        self.channel = grpc.insecure_channel(process.address, options=OPTIONS)
        self.stub = stub(self.channel)

    def assert_serving(self) -> None:
        assert self.process.process.poll() is None, f"{self.service} died"
        assert_serving(self.channel, self.service)

    def load(self) -> tuple:
        r = self.stub.Load(pb.LoadRequest(), timeout=TIMEOUT_S)
        return (r.contexts, r.queued) if isinstance(r, pb.DrafterLoadReply) else (r.running, r.waiting, r.kv_used)


def assert_serving(channel: grpc.Channel, service: str) -> None:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def status(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as error:
        return error.code()
    return OK


def exchange(method, msg) -> list:
    """One message on a fresh stream, then the client half-closes (which frees a request it served)."""
    return list(method(iter([msg]), timeout=TIMEOUT_S))


def settled(tier: Tier, want: tuple, timeout_s: float = 10.0) -> tuple:
    """The tier's load once it equals `want` (a stream's end frees state asynchronously), else the last read."""
    deadline = time.monotonic() + timeout_s
    while (got := tier.load()) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


@st.composite
def malformed(draw, base, faults: list, lim: Limits) -> tuple:
    """A valid message from `base` with one fault → (message, the status it must get: the one the fault returns,
    else INVALID_ARGUMENT)."""
    msg = base(draw, lim)
    code = draw(st.sampled_from(faults))(draw, msg, lim)
    return msg, code if isinstance(code, grpc.StatusCode) else IA


def campaign(tiers: list[Tier], send, strategy, examples: int = 40) -> None:
    """Each malformed message gets its status and leaves every tier's load as it was; the tiers keep serving."""
    def check(case):
        msg, code = case
        before = [tier.load() for tier in tiers]
        got = status(lambda: send(msg))
        assert got == code, f"{got.name} instead of {code.name}"
        assert [tier.load() for tier in tiers] == before

    # No example database: every campaign shares `check`, and a saved example would replay into the others.
    settings(max_examples=examples, deadline=None, database=None)(given(strategy)(check))()
    for tier in tiers:
        tier.assert_serving()


@pytest.fixture(scope="module")
def tiers():
    drafters = [f"{TARGET}-{m}" for m in sorted(METHODS)]
    procs = start_tiers([("verifier", verifier_settings(lease_s=3600)),  # held requests outlive the campaigns
                         ("drafter", drafter_settings(drafters=drafters))])
    tiers = Tier(procs[0], rpc.VerifierStub, "dspark.v1.Verifier"), Tier(procs[1], rpc.DrafterStub, "dspark.v1.Drafter")
    yield tiers
    for tier in tiers:
        tier.channel.close()
        tier.process.stop()


@pytest.fixture(scope="module")
def lim(tiers) -> Limits:
    p = tiers[0].stub.Profile(pb.ProfileRequest(), timeout=TIMEOUT_S)
    tokenizer = TextTokenizer.from_dir(resolve_model(TARGET))
    prompts = [tokenizer.encode(text) for text in PROMPTS[:2]]
    reply = prefill(tiers[0], "features", prompts[0])
    tiers[0].stub.Release(pb.ReleaseRequest(request_id="features"), timeout=TIMEOUT_S)
    return Limits(p.vocab_size, p.max_len, len(p.tap_layers) * p.hidden_size,
                  ModelConfig.from_dir(resolve_model(TARGET)).max_context, prompts,
                  plain_greedy(prompts, [MAX_TOKENS] * len(prompts)), [*prompts[0], *reply.emitted], reply.features)


@pytest.fixture(autouse=True)
def _release_held(tiers):
    """A failed test leaves nothing held for the next one."""
    yield
    for tier in tiers:
        for rid in HELD:
            tier.stub.Release(pb.ReleaseRequest(request_id=rid), timeout=TIMEOUT_S)


def prefill(verifier: Tier, rid: str, prompt: list[int], **params) -> pb.PrefillReply:
    return verifier.stub.Prefill(pb.PrefillRequest(request_id=rid, prompt_ids=prompt, feature_dtype=pb.DTYPE_FLOAT32,
                                                   params=pb.SamplingParams(max_tokens=MAX_TOKENS, **params)),
                                 timeout=TIMEOUT_S)


def continues_greedy(verifier: Tier, rid: str, expected: list[int]) -> None:
    """Cycle 1 of a held greedy request, drafting the next two reference tokens, emits them and the bonus."""
    reply, = exchange(verifier.stub.Verify, pb.VerifyRequest(request_id=rid, cycle=1,
                                                             draft=pb.DraftBlock(tokens=expected[1:3])))
    assert list(reply.emitted) == expected[1:4] and reply.num_accepted == 2


def tensor(x: np.ndarray) -> pb.Tensor:
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=list(x.shape), data=np.asarray(x, np.float32).tobytes())


def zeros(rows: int, width: int) -> pb.Tensor:
    return pb.Tensor(dtype=pb.DTYPE_BFLOAT16, shape=[rows, width], data=bytes(2 * rows * width))


def _set(field, values) -> None:
    del field[:]
    field.extend(values)


def _poke(d, values, value):
    """`values` with one element, drawn, replaced by `value`."""
    values[d(st.integers(0, len(values) - 1))] = value
    return values


def _edit_floats(d, tensor_msg: pb.Tensor, edit) -> None:
    tensor_msg.data = edit(d, np.frombuffer(tensor_msg.data, np.float32).copy()).tobytes()


# ---- verifier ---------------------------------------------------------------------------------------------
PREFILL_FAULTS = [
    lambda d, m, L: m.prompt_ids.append(L.out_of_vocab(d)),
    lambda d, m, L: m.resume_ids.extend([1, L.out_of_vocab(d)]),
    lambda d, m, L: m.ClearField("prompt_ids"),
    lambda d, m, L: m.prompt_ids.extend([1] * d(st.integers(L.max_len, 4 * L.max_len))),
    lambda d, m, L: setattr(m.params, "max_tokens", d(st.integers(L.max_len, U32))),
    lambda d, m, L: setattr(m.params, "temperature", d(BAD_TEMPERATURE)),
    lambda d, m, L: setattr(m.params, "top_p", d(BAD_TOP_P)),
    lambda d, m, L: setattr(m, "feature_dtype", d(BAD_ENUM)),
    lambda d, m, L: setattr(m, "request_id", d(st.sampled_from(["", "held"]))),  # empty, or already in use
]


def base_prefill(d, L: Limits) -> pb.PrefillRequest:
    return pb.PrefillRequest(request_id=d(OTHER_ID), prompt_ids=d(st.lists(st.integers(0, L.vocab - 1), min_size=1,
                                                                           max_size=16)),
                             params=pb.SamplingParams(max_tokens=4, temperature=d(st.sampled_from([0.0, 1.0]))))


def test_malformed_prefills_are_rejected_and_hold_nothing(tiers, lim):
    verifier = tiers[0]
    prefill(verifier, "held", lim.prompts[0])
    campaign([verifier], lambda m: verifier.stub.Prefill(m, timeout=TIMEOUT_S), malformed(base_prefill,
                                                                                         PREFILL_FAULTS, lim))
    continues_greedy(verifier, "held", lim.greedy[0])
    assert settled(verifier, (0, 0, 0)) == (0, 0, 0)


def valid_block(tokens: list[int], width: int, vocab: int) -> pb.DraftBlock:
    """Drafts with a sparse q of `width` distinct ids per row, the draft token first, uniform probabilities."""
    ids = [(t + j) % vocab for t in tokens for j in range(width)]
    return pb.DraftBlock(tokens=tokens, q=pb.SparseQ(width=width, token_ids=ids, probs=tensor(
        np.full((len(tokens), width), 1 / width))), confidences=[0.5] * len(tokens), peaks=[0.5] * len(tokens))


def _only(m, tokens: list[int], q: pb.SparseQ | None = None) -> None:
    """The block becomes just these tokens (and this q)."""
    m.draft.Clear()
    m.draft.tokens.extend(tokens)
    if q is not None:
        m.draft.q.CopyFrom(q)


def _transpose(shape) -> None:
    _set(shape, [shape[1], shape[0]] if shape[0] != shape[1] else [*shape, 1])


VERIFY_FAULTS = [
    lambda d, m, L: (setattr(m, "cycle", d(st.just(0) | st.integers(2, 2**64 - 1))), FP)[1],
    lambda d, m, L: (setattr(m, "request_id", d(OTHER_ID)), FP)[1],
    lambda d, m, L: _set(m.draft.tokens, _poke(d, list(m.draft.tokens), L.out_of_vocab(d))),
    lambda d, m, L: _only(m, [1] * d(st.integers(MAX_GAMMA + 1, 4 * L.max_len))),
    lambda d, m, L: _only(m, [], valid_block([1], 2, L.vocab).q),  # a q without drafts
    lambda d, m, L: m.draft.q.token_ids.pop() if d(st.booleans()) else m.draft.q.token_ids.append(1),
    lambda d, m, L: setattr(m.draft.q, "width", m.draft.q.width + d(st.integers(1, U32 - 64))),
    lambda d, m, L: _transpose(m.draft.q.probs.shape),
    lambda d, m, L: setattr(m.draft.q.probs, "data", m.draft.q.probs.data[: -d(st.integers(1, 4))]),
    lambda d, m, L: setattr(m.draft.q.probs, "dtype", d(BAD_ENUM | st.sampled_from([0, pb.DTYPE_BFLOAT16]))),
    lambda d, m, L: _edit_floats(d, m.draft.q.probs, lambda d, p: _poke(d, p, d(BAD_FLOAT | st.floats(-1e30, -1e-30)
                                                                                | st.floats(1.01, 1e30)))),
    lambda d, m, L: _edit_floats(d, m.draft.q.probs, lambda d, p: p * d(st.floats(0, 0.99) | st.floats(1.01, 1e6))),
    lambda d, m, L: _set(m.draft.q.token_ids, _poke(d, list(m.draft.q.token_ids), L.out_of_vocab(d))),
    lambda d, m, L: m.draft.q.token_ids.__setitem__(1, m.draft.q.token_ids[0]),  # a support id twice
    lambda d, m, L: m.draft.q.token_ids.__setitem__(0, (m.draft.tokens[0] + m.draft.q.width) % L.vocab),  # q(x) = 0
    lambda d, m, L: m.draft.confidences.pop() if d(st.booleans()) else m.draft.peaks.append(0.5),
    lambda d, m, L: _poke(d, m.draft.confidences if d(st.booleans()) else m.draft.peaks, d(BAD_FLOAT)),
    lambda d, m, L: setattr(m, "feature_dtype", d(BAD_ENUM)),
]


def base_verify(d, L: Limits) -> pb.VerifyRequest:
    tokens = d(st.lists(st.integers(0, L.vocab - 1), min_size=1, max_size=6))
    return pb.VerifyRequest(request_id=d(st.sampled_from(["held-g", "held-s"])), cycle=1,
                            draft=valid_block(tokens, d(st.integers(2, 8)), L.vocab))


def test_malformed_verify_cycles_are_rejected_and_change_nothing(tiers, lim):
    verifier = tiers[0]
    prefill(verifier, "held-g", lim.prompts[0])
    prefill(verifier, "held-s", lim.prompts[1], temperature=0.8, seed=7)
    campaign([verifier], lambda m: exchange(verifier.stub.Verify, m), malformed(base_verify, VERIFY_FAULTS, lim), 60)
    continues_greedy(verifier, "held-g", lim.greedy[0])
    reply, = exchange(verifier.stub.Verify, pb.VerifyRequest(request_id="held-s", cycle=1,
                                                             draft=valid_block([5, 6, 7], 4, lim.vocab)))
    assert reply.cycle == 1 and len(reply.emitted) == reply.num_accepted + 1 and reply.num_drafts == 3
    assert settled(verifier, (0, 0, 0)) == (0, 0, 0)


# ---- drafter ----------------------------------------------------------------------------------------------
def _reshape(d, shape) -> None:
    rows, width = shape
    _set(shape, d(st.sampled_from([[rows * width], [1, rows, width], [rows, width, 1]])))


FEATURE_FAULTS = [  # shared by Open and Draft: only the features tensor is malformed
    lambda d, m, L: m.features.CopyFrom(tensor(np.zeros((m.features.shape[0], d(st.integers(1, 2 * L.width).filter(
        lambda w: w != L.width)))))),
    lambda d, m, L: _reshape(d, m.features.shape),
    lambda d, m, L: setattr(m.features, "data", d(st.sampled_from([m.features.data[:-3], m.features.data + b"\0"]))),
    lambda d, m, L: setattr(m.features, "dtype", d(BAD_ENUM | st.just(0))),
    lambda d, m, L: _edit_floats(d, m.features, lambda d, x: _poke(d, x, d(BAD_FLOAT | st.floats(2 * MAX_FEATURE,
                                                                                                  3e38)))),
    lambda d, m, L: m.features.ClearField("shape"),  # bytes without a shape
    lambda d, m, L: (_set(m.features.shape, d(st.sampled_from([[0, U32], [U32, U32], [U32]]))), m.features.ClearField(
        "data")),  # absurd dimensions
]
OPEN_FAULTS = [
    lambda d, m, L: _set(m.context_ids, _poke(d, list(m.context_ids), L.out_of_vocab(d))),
    lambda d, m, L: (m.ClearField("context_ids"), m.ClearField("features")),
    lambda d, m, L: m.context_ids.append(1),  # one token more than the feature rows cover
    lambda d, m, L: setattr(m, "method", d(st.text(min_size=1).filter(lambda s: s not in METHODS))),
    lambda d, m, L: setattr(m.params, "temperature", d(BAD_TEMPERATURE)),
    lambda d, m, L: setattr(m, "request_id", ""),
    lambda d, m, L: (m.context_ids.extend([1] * (L.positions - len(m.context_ids) + d(st.integers(1, 4)))),
                     m.features.CopyFrom(zeros(len(m.context_ids) - 1, L.width))),  # past the position table
    *FEATURE_FAULTS,
]


def base_open(d, L: Limits, rid: str | None = None, cycle: int = 0, method: str | None = None) -> pb.OpenRequest:
    return pb.OpenRequest(request_id=rid or d(st.just("held-d") | OTHER_ID), context_ids=L.context, cycle=cycle,
                          features=L.features, params=pb.SamplingParams(max_tokens=MAX_TOKENS),
                          method=method or d(st.sampled_from(sorted(METHODS))))


def drafts_like_a_fresh_context(drafter: Tier, lim: Limits, cycle: int, method: str) -> None:
    """The held context drafts exactly what a context opened now from the same tokens and features drafts."""
    drafter.stub.Open(base_open(None, lim, "twin-d", cycle, method), timeout=TIMEOUT_S)
    blocks = [exchange(drafter.stub.Draft, pb.DraftRequest(request_id=rid, cycle=cycle + 1, gamma=7))[0].block
              for rid in ("held-d", "twin-d")]
    assert list(blocks[0].tokens) == list(blocks[1].tokens) and len(blocks[0].tokens) == 7
    assert settled(drafter, (0, 0)) == (0, 0)


def test_malformed_opens_are_rejected_and_hold_nothing(tiers, lim):
    drafter = tiers[1]
    drafter.stub.Open(base_open(None, lim, "held-d", method="eagle3"), timeout=TIMEOUT_S)  # the chain drafter
    campaign([drafter], lambda m: drafter.stub.Open(m, timeout=TIMEOUT_S), malformed(base_open, OPEN_FAULTS, lim))
    drafts_like_a_fresh_context(drafter, lim, 0, "eagle3")


DRAFT_FAULTS = [
    lambda d, m, L: (setattr(m, "cycle", d(st.integers(0, 3))), FP)[1],
    lambda d, m, L: (setattr(m, "request_id", d(OTHER_ID)), FP)[1],
    lambda d, m, L: _set(m.new_ids, [L.out_of_vocab(d)]),
    lambda d, m, L: m.new_ids.append(1),  # a token without its feature row
    lambda d, m, L: m.ClearField("features"),
    lambda d, m, L: setattr(m, "feature_start", d(st.integers(0, U32).filter(lambda s: s != m.feature_start))),
    lambda d, m, L: setattr(m, "gamma", d(st.integers(MAX_GAMMA + 1, U32))),
    lambda d, m, L: (m.new_ids.extend([1] * (L.positions - m.feature_start + d(st.integers(0, 3)))),
                     m.features.CopyFrom(zeros(len(m.new_ids), L.width))),  # past the position table
    *FEATURE_FAULTS,
]


def base_draft(d, L: Limits) -> pb.DraftRequest:
    """Cycle 4 or later of a context opened at cycle 3: one new token and its feature row."""
    return pb.DraftRequest(request_id="held-d", cycle=d(st.integers(4, 2**64 - 1)), new_ids=[d(st.integers(
        0, L.vocab - 1))], feature_start=len(L.context) - 1, features=tensor(np.zeros((1, L.width))),
        gamma=d(st.integers(0, MAX_GAMMA)))


def test_malformed_draft_cycles_are_rejected_and_change_nothing(tiers, lim):
    drafter = tiers[1]
    drafter.stub.Open(base_open(None, lim, "held-d", 3, "dspark"), timeout=TIMEOUT_S)  # the block drafter
    campaign([drafter], lambda m: exchange(drafter.stub.Draft, m), malformed(base_draft, DRAFT_FAULTS, lim), 60)
    full = base_open(None, lim, "full-d", 0, "dspark")  # a context filling the position table: a shorter block
    _set(full.context_ids, [1] * lim.positions)
    full.features.CopyFrom(zeros(lim.positions - 1, lim.width))
    drafter.stub.Open(full, timeout=TIMEOUT_S)
    reply, = exchange(drafter.stub.Draft, pb.DraftRequest(request_id="full-d", cycle=1, gamma=MAX_GAMMA))
    assert len(reply.block.tokens) == 1
    drafts_like_a_fresh_context(drafter, lim, 3, "dspark")


# ---- router -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def router(tiers, lim):
    """dspark.v1.Router served from this process (its own event loop, in a thread) over the two tiers."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        clients = GrpcVerifier(tiers[0].process.address), GrpcDrafter(tiers[1].process.address)
        tokenizer = TextTokenizer.from_dir(resolve_model(TARGET))
        router = Router(*clients, METHODS, RouterConfig(default=Speculation("dspark", Policy.FIXED, 7)), tokenizer)
        server = GrpcServer("127.0.0.1", 0, ["dspark.v1.Router"])
        rpc.add_RouterServicer_to_server(RouterServicer(router, tokenizer, lim.max_len), server.server)
        await server.start()
        return server, clients

    async def stop():
        await server.stop(0)
        for client in clients:
            await client.close()

    server, clients = asyncio.run_coroutine_threadsafe(start(), loop).result(TIMEOUT_S)
    channel = grpc.insecure_channel(server.address, options=OPTIONS)
    yield rpc.RouterStub(channel), channel, thread
    channel.close()
    asyncio.run_coroutine_threadsafe(stop(), loop).result(TIMEOUT_S)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


GENERATE_FAULTS = [
    lambda d, m, L: setattr(m, "prompt", d(st.text(min_size=1))),  # both prompt and prompt_ids
    lambda d, m, L: m.ClearField("prompt_ids"),  # neither
    lambda d, m, L: m.prompt_ids.append(L.out_of_vocab(d)),
    lambda d, m, L: m.prompt_ids.extend([1] * d(st.integers(L.max_len, 4 * L.max_len))),
    lambda d, m, L: setattr(m.params, "max_tokens", d(st.integers(L.max_len, U32))),
    lambda d, m, L: setattr(m.params, "temperature", d(BAD_TEMPERATURE)),
    lambda d, m, L: setattr(m.params, "top_p", d(BAD_TOP_P)),
    lambda d, m, L: setattr(m.speculative, "method", d(st.text(min_size=1).filter(lambda s: s not in {*METHODS,
                                                                                                      "none"}))),
    lambda d, m, L: setattr(m.speculative, "policy", d(st.text(min_size=1).filter(lambda s: s not in set(Policy)))),
    lambda d, m, L: setattr(m.speculative, "gamma", d(st.integers(RouterConfig().max_gamma + 1, U32))),
    lambda d, m, L: setattr(m.speculative, "min_tokens_per_s", d(BAD_FLOAT | st.floats(-3e38, -1e-30))),
    lambda d, m, L: m.stop.extend(d(st.lists(st.text(min_size=1), min_size=MAX_STOP_STRINGS + 1, max_size=32))),
    lambda d, m, L: m.stop.append(""),
    lambda d, m, L: m.stop_token_ids.extend([1] * d(st.integers(MAX_STOP_TOKEN_IDS + 1, 100_000))),
    lambda d, m, L: m.stop_token_ids.append(L.out_of_vocab(d)),
]


def test_malformed_generate_requests_are_rejected_and_change_nothing(tiers, router, lim):
    stub, channel, thread = router
    prefill(tiers[0], "held-r", lim.prompts[0])  # a router client below names its own request "held-r" too
    valid = pb.GenerateRequest(prompt_ids=lim.prompts[1], params=pb.SamplingParams(max_tokens=MAX_TOKENS))
    campaign(list(tiers), lambda m: list(stub.Generate(m, timeout=TIMEOUT_S)),
             malformed(lambda d, L: pb.GenerateRequest.FromString(valid.SerializeToString()), GENERATE_FAULTS, lim))
    assert thread.is_alive()
    assert_serving(channel, "dspark.v1.Router")
    valid.request_id = "held-r"
    chunks = list(stub.Generate(valid, timeout=TIMEOUT_S))
    assert [t for c in chunks for t in c.token_ids] == lim.greedy[1] and {c.request_id for c in chunks} == {"held-r"}
    continues_greedy(tiers[0], "held-r", lim.greedy[0])  # the router's "held-r" left the verifier's own alone
    assert (settled(tiers[0], (0, 0, 0)), settled(tiers[1], (0, 0))) == ((0, 0, 0), (0, 0))

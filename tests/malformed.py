"""Malformed `dspark.v1` messages for tests/test_grpc_bad_input.py, as hypothesis strategies.

A campaign draws a valid message from a `base_*` builder, then one fault from a `*_FAULTS` list. A fault is
`(draw, message, limits) -> status | None`: it spoils the message in place and returns the status the call
must end with when that is not INVALID_ARGUMENT (FAILED_PRECONDITION for a stale cycle or an unknown request).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc
import numpy as np
from hypothesis import strategies as st

from protos.dspark.v1 import dspark_pb2 as pb
from protos.validate import MAX_FEATURE, MAX_GAMMA, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MIN_TEMPERATURE
from router.router import RouterConfig
from router.scheduling.policy import Policy

IA, FP = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
METHODS = {"dspark", "eagle3"}  # one block drafter, one chain drafter
MAX_TOKENS, U32 = 8, 2**32 - 1
NAN, INF = float("nan"), float("inf")
BAD_FLOAT = st.sampled_from([NAN, INF, -INF, 1e30, -3e38])
BAD_TEMPERATURE = (BAD_FLOAT | st.floats(max_value=-1e-300) | st.floats(100.001, 1e300)
                   | st.floats(5e-324, MIN_TEMPERATURE, exclude_max=True))
BAD_TOP_P = st.just(NAN) | st.floats(max_value=-1e-300) | st.floats(min_value=1.0, exclude_min=True)
BAD_ENUM = st.integers(4, 2**31 - 1) | st.integers(-(2**31), -1)
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


@st.composite
def malformed(draw, base, faults: list, lim: Limits) -> tuple:
    """A valid message from `base` with one fault → (message, the status it must get: the one the fault returns,
    else INVALID_ARGUMENT)."""
    msg = base(draw, lim)
    code = draw(st.sampled_from(faults))(draw, msg, lim)
    return msg, code if isinstance(code, grpc.StatusCode) else IA


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
    lambda d, m, L: setattr(m, "plain_depth", d(st.integers(65, U32))),  # deeper than a replica runs ahead
    lambda d, m, L: setattr(m, "stream_interval", d(st.integers(1, U32))),  # without plain_depth, or wider
]


def base_prefill(d, L: Limits) -> pb.PrefillRequest:
    return pb.PrefillRequest(request_id=d(OTHER_ID), prompt_ids=d(st.lists(st.integers(0, L.vocab - 1), min_size=1,
                                                                           max_size=16)),
                             params=pb.SamplingParams(max_tokens=4, temperature=d(st.sampled_from([0.0, 1.0]))))


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
    # one value too many (popping one could leave a one-draft block with no confidences: a valid block)
    lambda d, m, L: (m.draft.confidences if d(st.booleans()) else m.draft.peaks).append(0.5),
    lambda d, m, L: _poke(d, m.draft.confidences if d(st.booleans()) else m.draft.peaks, d(BAD_FLOAT)),
    lambda d, m, L: setattr(m, "feature_dtype", d(BAD_ENUM)),
]


def base_verify(d, L: Limits) -> pb.VerifyRequest:
    tokens = d(st.lists(st.integers(0, L.vocab - 1), min_size=1, max_size=6))
    return pb.VerifyRequest(request_id=d(st.sampled_from(["held-g", "held-s"])), cycle=1,
                            draft=valid_block(tokens, d(st.integers(2, 8)), L.vocab))


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


def full_open(L: Limits) -> pb.OpenRequest:
    """A context filling the position table, whose Draft can only be a shorter block."""
    full = base_open(None, L, "full-d", 0, "dspark")
    _set(full.context_ids, [1] * L.positions)
    full.features.CopyFrom(zeros(L.positions - 1, L.width))
    return full


DRAFT_FAULTS = [
    lambda d, m, L: (setattr(m, "cycle", d(st.integers(0, 3))), FP)[1],
    lambda d, m, L: (setattr(m, "request_id", d(OTHER_ID)), FP)[1],
    lambda d, m, L: _set(m.new_ids, [L.out_of_vocab(d)]),
    lambda d, m, L: m.new_ids.append(1),  # a token without its feature row
    lambda d, m, L: m.ClearField("features"),
    lambda d, m, L: setattr(m, "feature_start", d(st.integers(0, U32).filter(lambda s: s != m.feature_start))),
    lambda d, m, L: setattr(m, "gamma", d(st.integers(MAX_GAMMA + 1, U32))),
    lambda d, m, L: setattr(m, "ahead", True),  # an ahead notice carries no delta
    lambda d, m, L: (setattr(m, "ahead", True), setattr(m, "taken", True),  # one for a pushed block: a valid delta
                     _set(m.new_ids, [L.out_of_vocab(d)])),
    lambda d, m, L: _notice(m, d(st.integers(0, 8)), d(st.integers(1, 3))),  # accept of the wrong length
    lambda d, m, L: _notice(m, d(st.integers(1, 8)), 0, d(st.sampled_from([-0.5, 1.5, math.nan, math.inf]))),
    lambda d, m, L: (m.new_ids.extend([1] * (L.positions - m.feature_start + d(st.integers(0, 3)))),
                     m.features.CopyFrom(zeros(len(m.new_ids), L.width))),  # past the position table
    *FEATURE_FAULTS,
]


def _notice(m: pb.DraftRequest, gamma: int, extra: int, bad: float | None = None) -> None:
    """Turn a draft request into an ahead notice for `gamma` drafts whose accept list is `extra` values too long,
    or has `bad` (not a probability) as its last value."""
    m.ClearField("new_ids")
    m.ClearField("features")
    m.ahead, m.gamma = True, gamma
    values = [0.5] * (gamma + extra)
    if bad is not None:
        values[-1] = bad
    _set(m.accept, values)


def base_draft(d, L: Limits) -> pb.DraftRequest:
    """Cycle 4 or later of a context opened at cycle 3: one new token and its feature row."""
    return pb.DraftRequest(request_id="held-d", cycle=d(st.integers(4, 2**64 - 1)), new_ids=[d(st.integers(
        0, L.vocab - 1))], feature_start=len(L.context) - 1, features=tensor(np.zeros((1, L.width))),
        gamma=d(st.integers(0, MAX_GAMMA)))


# ---- router -----------------------------------------------------------------------------------------------
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

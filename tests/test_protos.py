"""The wire contract: generated code in sync with the .proto, and lossless conversions."""

from __future__ import annotations

import pytest
import torch

from protos import codec
from protos.dspark.v1 import dspark_pb2 as pb
from protos.generate import drift
from services.calls import AheadCall, DraftCall, Pushed
from services.errors import InvalidRequestError
from services.types import DraftBlock, OutcomeKind, SamplingParams, StepOutput, TokenLogprobs


def test_generated_code_matches_the_proto():
    assert drift() == []


def test_features_travel_as_packed_bytes_bit_exactly():
    x = torch.randn(5, 12)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        msg = codec.tensor_to_pb(x, dtype)
        assert len(msg.data) == 5 * 12 * dtype.itemsize and list(msg.shape) == [5, 12]
        back = codec.tensor_from_pb(pb.Tensor.FromString(msg.SerializeToString()))
        assert back.dtype == dtype and torch.equal(back, x.to(dtype))
    assert codec.tensor_from_pb(codec.tensor_to_pb(None)) is None


def test_sparse_q_round_trip_is_exact_fp32():
    probs = torch.softmax(torch.randn(3, 8), -1)
    block = DraftBlock(tokens=[5, 9, 2], q_ids=torch.arange(24).reshape(3, 8), q_probs=probs,
                       confidences=[0.9, 0.5, 0.25])
    back = codec.block_from_pb(pb.DraftBlock.FromString(codec.block_to_pb(block).SerializeToString()))
    assert back.tokens == block.tokens and torch.equal(back.q_ids, block.q_ids) and torch.equal(back.q_probs, probs)
    assert back.confidences == pytest.approx(block.confidences)  # estimates travel as fp32
    greedy = codec.block_from_pb(codec.block_to_pb(DraftBlock(tokens=[1, 2])))
    assert greedy.q_ids is None and greedy.confidences is None


def test_an_ahead_notice_for_a_pushed_block_carries_its_delta_and_the_reply_its_blocks():
    taken = DraftCall("r", 5, [4, 9], 11, torch.randn(2, 6), 0)
    msg = pb.DraftRequest.FromString(codec.ahead_call_to_pb(AheadCall("r", 5, 3, [0.5, 0.25, 0.75], taken))
                                     .SerializeToString())
    assert (msg.ahead, msg.taken, list(msg.new_ids), msg.feature_start, msg.gamma) == (True, True, [4, 9], 11, 3)
    assert torch.equal(codec.tensor_from_pb(msg.features), taken.features)
    plain = codec.ahead_call_to_pb(AheadCall("r", 5, 3))
    assert not plain.taken and not plain.new_ids and not plain.features.ByteSize()
    pushed = [Pushed(0, 7, DraftBlock(tokens=[1, 2, 3], confidences=[0.5, 0.5, 0.5], ahead=True)), Pushed(2, 8,
              DraftBlock(tokens=[4]))]
    reply = pb.DraftReply.FromString(pb.DraftReply(pushed=codec.pushed_to_pb(pushed)).SerializeToString())
    back = codec.pushed_from_pb(reply.pushed)
    assert [(p.accepted, p.token, p.block.tokens, p.block.ahead) for p in back] == [(0, 7, [1, 2, 3], True),
                                                                                  (2, 8, [4], False)]


def test_outcome_and_params_round_trip():
    out = StepOutput("r", emitted=[4, 5], num_drafts=3, num_accepted=1, kind=OutcomeKind.RECOVERED,
                     feature_start=7, features=torch.randn(2, 6))
    back = codec.outcome_from_pb(codec.outcome_to_pb(out, 10, torch.float32))
    assert (back.emitted, back.num_drafts, back.num_accepted, back.kind, back.feature_start) == (
        [4, 5], 3, 1, OutcomeKind.RECOVERED, 7)
    assert torch.equal(back.features, out.features)
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3, max_tokens=11)
    assert codec.params_from_pb(codec.params_to_pb(params)) == params
    processed = SamplingParams(repetition_penalty=1.5, frequency_penalty=-0.5, presence_penalty=0.25, min_p=0.5,
                               min_tokens=3, logit_bias=((2, 1.5), (9, -4.0)), stop_token_ids=(0, 7), logprobs=0,
                               prompt_logprobs=5)
    assert codec.params_from_pb(codec.params_to_pb(processed)) == processed
    lp = TokenLogprobs([-0.5, -1.25], [[3, 4], [5, 6]], [[-0.5, -1.0], [-0.25, -2.0]])
    out.logprobs = lp
    assert codec.outcome_from_pb(codec.outcome_to_pb(out, 10, torch.float32)).logprobs == lp
    with pytest.raises(InvalidRequestError):  # top arrays not [n × top]
        codec.logprobs_from_pb(pb.TokenLogprobs(logprobs=[-1.0], top=2, top_ids=[1], top_logprobs=[-1.0]), True)
    with pytest.raises(InvalidRequestError):
        codec.params_from_pb(pb.SamplingParams(max_tokens=4, frequency_penalty=3.0))


def test_malformed_messages_are_invalid_arguments():
    with pytest.raises(InvalidRequestError):
        codec.tensor_from_pb(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 2], data=b"\0" * 3))
    with pytest.raises(InvalidRequestError):
        codec.block_from_pb(pb.DraftBlock(tokens=[1, 2], q=pb.SparseQ(width=4, token_ids=[1, 2, 3])))
    with pytest.raises(InvalidRequestError):
        codec.params_from_pb(pb.SamplingParams(temperature=-1, max_tokens=4))

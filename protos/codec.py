"""Typed contracts (services.types) ↔ `dspark.v1` messages. The only place that knows both."""

from __future__ import annotations

import math

import torch

from protos.dspark.v1 import dspark_pb2 as pb
from services.calls import AheadCall, DraftCall, OpenCall, PrefillCall, Pushed, VerifyCall
from services.errors import InvalidRequestError
from services.types import (
    DraftBlock,
    Grammar,
    GrammarKind,
    OutcomeKind,
    PlainRun,
    SamplingParams,
    StepOutput,
    TokenLogprobs,
)

_DTYPES = {pb.DTYPE_FLOAT32: torch.float32, pb.DTYPE_BFLOAT16: torch.bfloat16, pb.DTYPE_FLOAT16: torch.float16}
_WIRE = {v: k for k, v in _DTYPES.items()}
_OUTCOMES = {OutcomeKind.BONUS: pb.OUTCOME_BONUS, OutcomeKind.RECOVERED: pb.OUTCOME_RECOVERED,
             OutcomeKind.FIRST: pb.OUTCOME_FIRST}
_KINDS = {v: k for k, v in _OUTCOMES.items()}
_MAX_DIMS = 8  # every tensor of the contract has two; more is a malformed message, not a bigger tensor


def wire_dtype(value: int) -> torch.dtype:
    """A DType field → torch dtype; UNSPECIFIED means bf16 (the default for features)."""
    if value == pb.DTYPE_UNSPECIFIED:
        return torch.bfloat16
    if value not in _DTYPES:
        raise InvalidRequestError(f"unknown dtype {value}")
    return _DTYPES[value]


def dtype_field(dtype: torch.dtype) -> int:
    return _WIRE[dtype]


def tensor_to_pb(x: torch.Tensor | None, dtype: torch.dtype | None = None) -> pb.Tensor:
    """Pack a tensor as little-endian bytes (x86 and ARM are little-endian; torch stores native order)."""
    if x is None:
        return pb.Tensor()
    x = x.detach().to("cpu", dtype or x.dtype).contiguous()
    raw = x.view(torch.int16) if x.dtype in (torch.bfloat16, torch.float16) else x  # numpy has no bf16
    return pb.Tensor(dtype=_WIRE[x.dtype], shape=list(x.shape), data=raw.numpy().tobytes())


def tensor_from_pb(msg: pb.Tensor) -> torch.Tensor | None:
    """The tensor of a Tensor message, or None when it has neither shape nor data."""
    if not msg.shape:
        if msg.data:
            raise InvalidRequestError(f"tensor of {len(msg.data)} bytes has no shape")
        return None
    if len(msg.shape) > _MAX_DIMS:
        raise InvalidRequestError(f"tensor of {len(msg.shape)} dimensions; at most {_MAX_DIMS}")
    if msg.dtype not in _DTYPES:  # UNSPECIFIED defaults a feature_dtype field, never a tensor's own dtype
        raise InvalidRequestError(f"unknown tensor dtype {msg.dtype}")
    dtype, shape = _DTYPES[msg.dtype], tuple(msg.shape)
    count = math.prod(shape)
    if len(msg.data) != count * dtype.itemsize:
        raise InvalidRequestError(f"tensor of shape {list(shape)} needs {count * dtype.itemsize} bytes, "
                                  f"got {len(msg.data)}")
    if count == 0:  # frombuffer refuses an empty buffer
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(msg.data), dtype=dtype).reshape(shape)


def params_to_pb(p: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed, max_tokens=p.max_tokens,
        repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty, min_p=p.min_p, min_tokens=p.min_tokens, logit_bias=dict(p.logit_bias),
        stop_token_ids=p.stop_token_ids, logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs,
        allowed_token_ids=p.allowed_token_ids, bad_words=[pb.TokenIds(ids=w) for w in p.bad_words],
        grammar=None if p.grammar is None else pb.Grammar(kind=p.grammar.kind.value, text=p.grammar.text),
        typical_p=p.typical_p,
    )


def params_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    """Validated by SamplingParams itself (InvalidRequestError on out-of-range values)."""
    return SamplingParams(
        temperature=msg.temperature, top_p=msg.top_p or 1.0, top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None, max_tokens=msg.max_tokens or 1,
        repetition_penalty=msg.repetition_penalty or 1.0, frequency_penalty=msg.frequency_penalty,
        presence_penalty=msg.presence_penalty, min_p=msg.min_p, min_tokens=msg.min_tokens,
        logit_bias=tuple(sorted(msg.logit_bias.items())), stop_token_ids=tuple(msg.stop_token_ids),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        allowed_token_ids=tuple(msg.allowed_token_ids), bad_words=tuple(tuple(w.ids) for w in msg.bad_words),
        grammar=_grammar_from_pb(msg.grammar) if msg.HasField("grammar") else None,
        typical_p=msg.typical_p or 1.0,
    )


def _grammar_from_pb(msg: pb.Grammar) -> Grammar:
    if msg.kind not in GrammarKind.__members__.values():
        raise InvalidRequestError(f"grammar kind {msg.kind!r}: one of {', '.join(k.value for k in GrammarKind)}")
    return Grammar(GrammarKind(msg.kind), msg.text)


def logprobs_to_pb(lp: TokenLogprobs | None) -> pb.TokenLogprobs | None:
    if lp is None:
        return None
    top = len(lp.top_ids[0]) if lp.top_ids else 0
    return pb.TokenLogprobs(logprobs=lp.logprobs, top=top, top_ids=[t for row in lp.top_ids for t in row],
                            top_logprobs=[v for row in lp.top_logprobs for v in row])


def logprobs_from_pb(msg: pb.TokenLogprobs, present: bool) -> TokenLogprobs | None:
    """None when the field is absent; a message whose top arrays are not [n * top] is malformed."""
    if not present:
        return None
    n, k = len(msg.logprobs), msg.top
    if len(msg.top_ids) != n * k or len(msg.top_logprobs) != n * k:
        raise InvalidRequestError(f"token logprobs: {len(msg.top_ids)} top ids for {n} tokens × {k}")
    ids, values = list(msg.top_ids), list(msg.top_logprobs)
    return TokenLogprobs(list(msg.logprobs), [ids[i * k : (i + 1) * k] for i in range(n)],
                         [values[i * k : (i + 1) * k] for i in range(n)])


def plain_run_to_pb(plain: PlainRun | None) -> dict:
    """The PrefillRequest (or VerifyRequest) fields of a plain run (none: both 0)."""
    return {} if plain is None else {"plain_depth": plain.depth, "stream_interval": plain.interval}


def plain_run_from_pb(msg: pb.PrefillRequest | pb.VerifyRequest) -> PlainRun | None:
    """plain_depth 0 is no plain run (a stream_interval alone is then refused); stream_interval 0 means 1."""
    if not msg.plain_depth:
        if msg.stream_interval:
            raise InvalidRequestError("stream_interval needs plain_depth")
        return None
    return PlainRun(msg.plain_depth, msg.stream_interval or 1)


def block_to_pb(block: DraftBlock | None) -> pb.DraftBlock:
    if block is None or not block.tokens:
        return pb.DraftBlock()
    msg = pb.DraftBlock(tokens=block.tokens, confidences=block.confidences or [], peaks=block.peaks or [],
                        ahead=block.ahead, fanout=block.fanout)
    if block.q_ids is not None:
        msg.q.width = block.q_ids.shape[1]
        msg.q.token_ids.extend(block.q_ids.reshape(-1).tolist())
        msg.q.probs.CopyFrom(tensor_to_pb(block.q_probs, torch.float32))
    return msg


def block_from_pb(msg: pb.DraftBlock) -> DraftBlock:
    """A structurally sound block: per-token arrays as long as the tokens, a sparse q of exactly [ℓ, K]."""
    tokens = list(msg.tokens)
    n = len(tokens)
    if msg.confidences and len(msg.confidences) != n:
        raise InvalidRequestError(f"{len(msg.confidences)} confidences for {n} draft tokens")
    if msg.peaks and len(msg.peaks) != n:
        raise InvalidRequestError(f"{len(msg.peaks)} peaks for {n} draft tokens")
    block = DraftBlock(tokens=tokens, confidences=list(msg.confidences) or None, peaks=list(msg.peaks) or None,
                       ahead=msg.ahead, fanout=msg.fanout)
    if msg.q.ByteSize():  # an all-default q is no q: one-hot at each draft
        block.q_ids, block.q_probs = _sparse_q(msg.q, n)
    return block


def _sparse_q(q: pb.SparseQ, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [n, K] int64 and fp32 probs [n, K] of a non-empty SparseQ."""
    width = q.width
    if not n or not width or len(q.token_ids) != n * width or q.probs.dtype != pb.DTYPE_FLOAT32:
        raise InvalidRequestError(f"sparse q must be [{n}, K >= 1] ids and fp32 probs for {n} draft tokens")
    probs = tensor_from_pb(q.probs)
    if probs is None or tuple(probs.shape) != (n, width):
        raise InvalidRequestError(f"sparse q probs must be [{n}, {width}]")
    return torch.tensor(list(q.token_ids), dtype=torch.long).reshape(n, width), probs


def outcome_to_pb(out: StepOutput, committed: int, dtype: torch.dtype) -> pb.VerifyReply:
    return pb.VerifyReply(
        request_id=out.request_id, emitted=out.emitted, num_drafts=out.num_drafts, num_accepted=out.num_accepted,
        outcome=_OUTCOMES.get(out.kind, pb.OUTCOME_UNSPECIFIED), feature_start=out.feature_start,
        features=tensor_to_pb(out.features, dtype), committed=committed, logprobs=logprobs_to_pb(out.logprobs),
    )


def outcome_from_pb(msg: pb.VerifyReply) -> StepOutput:
    return StepOutput(
        request_id=msg.request_id, emitted=list(msg.emitted), num_drafts=msg.num_drafts,
        num_accepted=msg.num_accepted, kind=_KINDS.get(msg.outcome), feature_start=msg.feature_start,
        features=tensor_from_pb(msg.features), logprobs=logprobs_from_pb(msg.logprobs, msg.HasField("logprobs")),
    )


# The calls of services/calls.py on the wire; the servers build them back, validating each field.
def prefill_call_to_pb(call: PrefillCall, feature_dtype: int) -> pb.PrefillRequest:
    return pb.PrefillRequest(request_id=call.request_id, prompt_ids=call.prompt_ids, params=params_to_pb(call.params),
                             resume_ids=call.resume_ids, feature_dtype=feature_dtype, traceparent=call.traceparent,
                             share_prefix_of=call.share_prefix_of, **plain_run_to_pb(call.plain))


def verify_call_to_pb(call: VerifyCall, feature_dtype: int) -> pb.VerifyRequest:
    return pb.VerifyRequest(request_id=call.request_id, cycle=call.cycle, draft=block_to_pb(call.draft),
                            feature_dtype=feature_dtype, traceparent=call.traceparent, **plain_run_to_pb(call.plain))


def open_call_to_pb(call: OpenCall) -> pb.OpenRequest:
    return pb.OpenRequest(request_id=call.request_id, context_ids=call.context_ids,
                          features=tensor_to_pb(call.features), params=params_to_pb(call.params), cycle=call.cycle,
                          method=call.method, traceparent=call.traceparent, output_start=call.output_start)


def draft_call_to_pb(call: DraftCall) -> pb.DraftRequest:
    return pb.DraftRequest(request_id=call.request_id, cycle=call.cycle, new_ids=call.new_ids,
                           feature_start=call.feature_start, features=tensor_to_pb(call.features), gamma=call.gamma,
                           traceparent=call.traceparent)


def ahead_call_to_pb(call: AheadCall) -> pb.DraftRequest:
    """An ahead notice rides the draft stream: a DraftRequest with `ahead` set and γ = the verify length; a
    notice for a pushed block carries the delta its draft call would have."""
    msg = pb.DraftRequest(request_id=call.request_id, cycle=call.cycle, gamma=call.verify_len, ahead=True,
                          accept=call.accept or [], taken=call.taken is not None)
    if call.taken is not None:
        msg.new_ids.extend(call.taken.new_ids)
        msg.feature_start = call.taken.feature_start
        msg.features.CopyFrom(tensor_to_pb(call.taken.features))
    return msg


def pushed_to_pb(pushed: list[Pushed]) -> list[pb.PushedBlock]:
    return [pb.PushedBlock(accepted=p.accepted, token=p.token, block=block_to_pb(p.block)) for p in pushed]


def pushed_from_pb(msgs) -> list[Pushed]:
    return [Pushed(m.accepted, m.token, block_from_pb(m.block)) for m in msgs]

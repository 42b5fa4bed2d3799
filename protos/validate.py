"""Value checks of incoming `dspark.v1` messages, run before anything reaches a model or a session.

The codec checks structure (lengths, byte counts, dtypes); these check values against a tier's limits:
token ids inside the vocabulary, finite features of the right width, sparse q rows that are distributions,
block sizes within MAX_GAMMA. A failure is an InvalidRequestError (INVALID_ARGUMENT on the wire) raised
before any state changes, so a rejected message changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from protos import codec
from protos.dspark.v1 import dspark_pb2 as pb
from services.errors import InvalidRequestError
from services.types import DraftBlock, SamplingParams

MAX_GAMMA = 64  # most drafts a block may carry or a Draft may ask for (published drafters use γ <= 16)
MAX_STOP_STRINGS = 16  # OpenAI takes 4, vLLM any number; 16 keeps the per-cycle stop check bounded
MAX_STOP_TOKEN_IDS = 256
# Below this, logits / T overflows fp32 to ±inf and sampling meets NaN (vLLM treats T < 1e-5 as greedy).
MIN_TEMPERATURE = 1e-5
# Bound on |feature|: far above the largest hidden-state activations reported for real LLMs (~1e4), far
# below what overflows the squares and sums of a drafter's norms and projections (fp32 x² overflows at 2e19).
MAX_FEATURE = 1e6
_SUM_TOLERANCE = 1e-3  # |Σ q − 1| allowed per sparse q row: drafters renormalise in fp32


def request_id(value: str) -> str:
    if not value:
        raise InvalidRequestError("request_id is empty")
    return value


def token_ids(ids: Iterable[int], vocab_size: int | None, what: str) -> list[int]:
    """ids as a list, each inside [0, vocab_size) (uint32 on the wire: never negative); None skips the check."""
    ids = list(ids)
    if vocab_size is not None and ids and max(ids) >= vocab_size:
        raise InvalidRequestError(f"{what} token id {max(ids)} outside the vocabulary [0, {vocab_size})")
    return ids


def gamma(value: int) -> int:
    if value > MAX_GAMMA:
        raise InvalidRequestError(f"gamma {value} exceeds {MAX_GAMMA}")
    return value


def acceptance(values, gamma: int) -> list[float] | None:
    """An ahead notice's per-draft acceptance estimates: none, or one probability per verified draft."""
    values = list(values)
    if not values:
        return None
    if len(values) != gamma:
        raise InvalidRequestError(f"accept has {len(values)} values for {gamma} verified drafts")
    if not all(0.0 <= v <= 1.0 for v in values):  # also refuses NaN
        raise InvalidRequestError("accept values must be probabilities in [0, 1]")
    return values


def params(msg: pb.SamplingParams) -> SamplingParams:
    if 0.0 < msg.temperature < MIN_TEMPERATURE:
        raise InvalidRequestError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got "
                                  f"{msg.temperature}")
    return codec.params_from_pb(msg)


def features(msg: pb.Tensor, width: int | None) -> torch.Tensor | None:
    """Target features [positions, width] with every value finite and within ±MAX_FEATURE; None when absent."""
    x = codec.tensor_from_pb(msg)
    if x is None:
        return None
    if x.dim() != 2 or (width is not None and x.shape[1] != width):
        raise InvalidRequestError(f"features must be [positions, {width or 'num_taps * hidden'}], got {list(x.shape)}")
    if not bool((x.float().abs() <= MAX_FEATURE).all()):  # NaN fails the comparison too
        raise InvalidRequestError(f"features must be finite and within ±{MAX_FEATURE:g}")
    return x


def draft_block(msg: pb.DraftBlock, vocab_size: int) -> DraftBlock:
    """A draft block of at most MAX_GAMMA in-vocabulary tokens whose q rows are distributions."""
    if len(msg.tokens) > MAX_GAMMA:
        raise InvalidRequestError(f"{len(msg.tokens)} draft tokens; at most {MAX_GAMMA}")
    if msg.q.width > vocab_size:
        raise InvalidRequestError(f"sparse q of width {msg.q.width} is wider than the vocabulary ({vocab_size})")
    block = codec.block_from_pb(msg)
    token_ids(block.tokens, vocab_size, "draft")
    for name, values in (("confidences", block.confidences), ("peaks", block.peaks)):
        if not all(0.0 <= v <= 1.0 for v in values or ()):  # probabilities (NaN fails the comparison too)
            raise InvalidRequestError(f"draft {name} must lie in [0, 1]")
    if block.q_ids is not None:
        _sparse_q(block.q_ids, block.q_probs, vocab_size)
    return block


def _sparse_q(ids: torch.Tensor, probs: torch.Tensor, vocab_size: int) -> None:
    """Each row: distinct in-vocabulary ids, probabilities in [0, 1] summing to 1."""
    if bool((ids >= vocab_size).any()):
        raise InvalidRequestError(f"sparse q token ids must lie in [0, {vocab_size})")
    ordered = ids.sort(-1).values
    if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
        raise InvalidRequestError("a sparse q row names a token id twice")
    if not bool(((probs >= 0) & (probs <= 1)).all()):  # NaN fails the comparisons too
        raise InvalidRequestError("sparse q probabilities must lie in [0, 1]")
    if not bool(((probs.sum(-1) - 1).abs() <= _SUM_TOLERANCE).all()):
        raise InvalidRequestError("each sparse q row must sum to 1")

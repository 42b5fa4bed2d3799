"""A drafter's configuration: which method, which target, which target features, which heads.

A drafter checkpoint is the target's `config.json` (same width, heads and MLP size; its own layer count)
with a `dspark_drafter` section holding this config. Embedding and LM head are the target's, frozen,
and are read from the target at load time rather than stored twice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from enum import StrEnum


class Method(StrEnum):
    MTP = "mtp"  # DeepSeek-V3 MTP module, one draft per cycle
    EAGLE3 = "eagle3"  # one decoder layer over fused features, autoregressive
    DFLASH = "dflash"  # parallel backbone over [anchor, MASK × (γ−1)]
    DSPARK = "dspark"  # dflash backbone + sequential head + confidence head

    @property
    def is_block(self) -> bool:
        return self in (Method.DFLASH, Method.DSPARK)


class HeadType(StrEnum):
    """DSpark sequential head: the prefix-dependent bias B_k added to the backbone logits U_k."""

    MARKOV = "markov"  # B_k = W2 · W1[x_{k−1}]
    GATED = "gated"  # B_k = W2 · (g ⊙ W1[x_{k−1}]), g = σ(Linear([h_k; W1[x_{k−1}]]))
    RNN = "rnn"  # GRU-like state over the in-block prefix


@dataclass(slots=True)
class DrafterConfig:
    method: Method
    target: str  # name of the target it was trained against
    tap_layers: tuple[int, ...]  # target decoder layers whose outputs it conditions on
    num_layers: int = 1
    block_size: int = 7  # γ it was trained for (TTT length for eagle3, 1 for mtp)
    mask_token_id: int | None = None  # block drafters: the [MASK] row of the target's embedding
    head: HeadType | None = None  # dspark only
    markov_rank: int = 0
    confidence_head: bool = False
    # Drafting over a reduced vocabulary (EAGLE-3's d2t, drafter_worker/base.py): the LM head has this many rows,
    # and draft id i is target id i + d2t[i]; None: the target's vocabulary and LM head.
    draft_vocab_size: int | None = None
    norm_before_residual: bool = False  # EAGLE-3 (vLLM speculators): residual = hidden_norm(hidden)
    # Block drafters: "anchor" — slot k of [anchor, MASK…] predicts the next position (DeepSpec, dspark);
    # "fill_in" — the γ MASK slots after the anchor each predict their own position (z-lab DFlash).
    layout: str = "anchor"

    def __post_init__(self) -> None:
        self.method = Method(self.method)
        self.head = None if self.head is None else HeadType(self.head)
        self.tap_layers = tuple(int(t) for t in self.tap_layers)
        if not self.tap_layers:
            raise ValueError("a drafter needs at least one target tap layer")
        if self.num_layers < 1 or self.block_size < 1:
            raise ValueError("num_layers and block_size must be >= 1")
        if self.method.is_block and self.mask_token_id is None:
            raise ValueError(f"{self.method} needs mask_token_id")
        if self.method is Method.MTP and self.block_size != 1:
            raise ValueError("mtp drafts exactly one token (block_size 1)")
        if (self.head is None) != (self.method is not Method.DSPARK):
            raise ValueError("a sequential head belongs to dspark, and dspark needs one")
        if self.head is not None and self.markov_rank < 1:
            raise ValueError("the sequential head needs markov_rank >= 1")
        if self.confidence_head and self.method is not Method.DSPARK:
            raise ValueError("only dspark has a confidence head")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError("draft_vocab_size must be >= 1")
        if self.norm_before_residual and self.method is not Method.EAGLE3:
            raise ValueError("norm_before_residual is an eagle3 option")
        if self.layout not in ("anchor", "fill_in") or (self.layout == "fill_in" and not self.method.is_block):
            raise ValueError(f"layout {self.layout!r}: anchor, or fill_in for block drafters")

    def to_dict(self) -> dict:
        out = asdict(self)
        out["tap_layers"] = list(self.tap_layers)
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> DrafterConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown drafter config keys: {', '.join(unknown)}")
        return cls(**raw)


def default_config(method: Method | str, target: str, tap_layers: tuple[int, ...], mask_token_id: int,
                   head: HeadType | str = HeadType.MARKOV, draft_vocab_size: int | None = None) -> DrafterConfig:
    """The shipped recipe per method: DSpark and DFlash share a 2-layer backbone and γ = 7, EAGLE-3 one
    layer unrolled 7 steps, MTP one layer and one draft; all over the same draft vocabulary."""
    method = Method(method)
    vd = draft_vocab_size
    if method is Method.MTP:
        return DrafterConfig(method, target, tap_layers, num_layers=1, block_size=1, draft_vocab_size=vd)
    if method is Method.EAGLE3:
        return DrafterConfig(method, target, tap_layers, num_layers=1, block_size=7, draft_vocab_size=vd)
    if method is Method.DFLASH:
        return DrafterConfig(method, target, tap_layers, num_layers=2, block_size=7, mask_token_id=mask_token_id,
                             draft_vocab_size=vd)
    return DrafterConfig(method, target, tap_layers, num_layers=2, block_size=7, mask_token_id=mask_token_id,
                         head=HeadType(head), markov_rank=128, confidence_head=True, draft_vocab_size=vd)

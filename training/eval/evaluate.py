"""Offline drafter evaluation (DeepSpec's metrics): generate through the engine with a fixed full block and
record, per cycle, the drafts' confidences and how many were accepted.

Vocabulary: τ = tokens emitted per cycle including the bonus/recovered token; unconditional acceptance at
position k = cycles whose first k drafts all survived / cycles that verified position k (prefix survival);
conditional = that rate divided by the rate at k − 1; draft acceptance rate = accepted / drafted. The
label of a_k = Π_{i≤k} c_i is "drafts 1..k all accepted".
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from drafter_worker.drafter import Drafter
from in_process.generation import GenerationRequest, GenerationResult, InProcessRouter
from router.scheduling.policy import Policy
from services.types import DraftBlock, SamplingParams, StepOutput
from verifier_worker.engine import Engine, EngineConfig


@dataclass(slots=True)
class CycleLog:
    """Per verified cycle: confidence logits z_k of the verified drafts and the accepted count."""

    logits: list[list[float]] = field(default_factory=list)  # [cycles][ℓ]
    accepted: list[int] = field(default_factory=list)  # [cycles]

    def __call__(self, request_id: str, block: DraftBlock | None, out: StepOutput) -> None:
        if block is None or block.confidences is None or not len(block):
            return
        self.logits.append([_logit(c) for c in block.confidences])
        self.accepted.append(out.num_accepted)

    def tensors(self, gamma: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """z [N, γ], prefix labels [N, γ] bool, valid [N, γ] bool (position verified in that cycle)."""
        n = len(self.accepted)
        z, valid = torch.zeros(n, gamma), torch.zeros(n, gamma, dtype=torch.bool)
        for i, row in enumerate(self.logits):
            z[i, : len(row)] = torch.tensor(row[:gamma])
            valid[i, : len(row)] = True
        accepted = torch.tensor(self.accepted)[:, None]
        labels = torch.arange(1, gamma + 1)[None] <= accepted
        return z, labels, valid


def _logit(c: float) -> float:
    c = min(max(c, 1e-7), 1 - 1e-7)
    return math.log(c / (1 - c))


@dataclass(slots=True)
class EvalRun:
    results: list[GenerationResult]
    cycles: CycleLog
    elapsed_s: float

    def summary(self, gamma: int) -> dict:
        cycles = sum(r.cycles for r in self.results)
        emitted = sum(r.cycle_tokens for r in self.results)
        drafted = sum(r.draft_tokens for r in self.results)
        accepted = sum(r.accepted_tokens for r in self.results)
        proposed = _sum_lists([r.proposed_per_pos for r in self.results], gamma)
        survived = _sum_lists([r.accepted_per_pos for r in self.results], gamma)
        uncond = [s / p if p else 0.0 for s, p in zip(survived, proposed, strict=True)]
        cond = [u / prev if prev else 0.0 for u, prev in zip(uncond, [1.0, *uncond[:-1]], strict=True)]
        tokens = sum(len(r.token_ids) for r in self.results)
        return {"prompts": len(self.results), "tokens": tokens, "cycles": cycles,
                "tau": emitted / cycles if cycles else 0.0, "draft_acceptance": accepted / drafted if drafted else 0.0,
                "accept_rate_at_k": uncond, "conditional_accept_at_k": cond,
                "tokens_per_s": tokens / self.elapsed_s if self.elapsed_s else 0.0}


def _sum_lists(rows: list[list[int]], width: int) -> list[int]:
    out = [0] * width
    for row in rows:
        for k, v in enumerate(row[:width]):
            out[k] += v
    return out


def run(target, drafter: Drafter | None, prompts: list[list[int]], gamma: int, params: SamplingParams,
        stop_ids: tuple[int, ...], batch: int, max_len: int = 1024) -> EvalRun:
    """Generate every prompt with the full block verified each cycle (no scheduler), `batch` at a time."""
    engine = Engine(target, EngineConfig(num_slots=batch, max_len=max_len))
    log = CycleLog()
    policy = Policy.FIXED if drafter is not None else Policy.NONE
    router = InProcessRouter(engine, drafter, policy, gamma, observer=log)
    requests = [GenerationRequest(f"p{i}", ids, SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        seed=None if params.seed is None else params.seed + i, max_tokens=params.max_tokens), stop_ids)
        for i, ids in enumerate(prompts)]
    start = time.perf_counter()
    results = router.generate(requests)
    return EvalRun(results, log, time.perf_counter() - start)

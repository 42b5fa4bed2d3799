"""Evaluation bookkeeping: τ, unconditional / conditional acceptance and the a_k labels."""

from __future__ import annotations

import math

import pytest
import torch

from in_process.generation import GenerationResult
from services.types import DraftBlock, FinishReason, OutcomeKind, StepOutput
from training.eval.evaluate import CycleLog, EvalRun


def _result(cycles: int, emitted: int, drafted: int, accepted: int, survived: list[int], proposed: list[int]):
    return GenerationResult("r", [1], [2] * emitted, FinishReason.LENGTH, cycles, emitted, drafted, accepted, survived,
                            1.0, proposed)


def test_summary_tau_and_acceptance_by_position():
    # 4 cycles of γ = 3: accepted 3, 1, 0, 2 → emitted 4 + 2 + 1 + 3 = 10
    run = EvalRun([_result(4, 10, 12, 6, [3, 2, 1], [4, 4, 4])], CycleLog(), 2.0)
    s = run.summary(3)
    assert s["tau"] == pytest.approx(10 / 4)
    assert s["draft_acceptance"] == pytest.approx(6 / 12)
    assert s["accept_rate_at_k"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])  # prefix survival
    assert s["conditional_accept_at_k"] == pytest.approx([3 / 4, 2 / 3, 1 / 2])


def test_cycle_log_labels_are_prefix_survival():
    log = CycleLog()
    for accepted, confs in ((2, [0.9, 0.8, 0.7]), (0, [0.5, 0.5]), (3, [0.6, 0.6, 0.6])):
        block = DraftBlock(tokens=[1] * len(confs), confidences=confs)
        log("r", block, StepOutput("r", [1], num_drafts=len(confs), num_accepted=accepted, kind=OutcomeKind.BONUS))
    log("r", DraftBlock(tokens=[]), StepOutput("r", [1], kind=OutcomeKind.BONUS))  # plain cycle: no record
    z, labels, valid = log.tensors(3)
    assert labels.tolist() == [[True, True, False], [False, False, False], [True, True, True]]
    assert valid.tolist() == [[True, True, True], [True, True, False], [True, True, True]]
    assert z[0, 0].item() == pytest.approx(math.log(0.9 / 0.1), rel=1e-5)
    assert torch.sigmoid(z[1, :2]).tolist() == pytest.approx([0.5, 0.5])

"""Online acceptance estimates: the prior is the signal, outcomes take over, labels come from ℓ and accepted."""

from __future__ import annotations

import random

import pytest

from router.scheduling.acceptance import AcceptanceModel
from services.types import DraftBlock


def test_signals_prefer_the_head_then_the_peaks():
    assert AcceptanceModel.signals(DraftBlock([1, 2], confidences=[0.9, 0.8], peaks=[0.5, 0.5])) == [0.9, 0.8]
    assert AcceptanceModel.signals(DraftBlock([1, 2], peaks=[0.5, 0.4])) == [0.5, 0.4]
    assert AcceptanceModel.signals(DraftBlock([1, 2])) == [None, None]


def test_without_outcomes_the_estimate_is_the_signal():
    m = AcceptanceModel()
    assert m.estimate("dspark", True, [0.93, 0.42, None]) == [0.93, 0.42, 0.5]


def test_outcomes_recalibrate_an_overconfident_signal():
    """The drafter says 0.85 but only 40 % of such drafts are accepted: the estimate follows the data."""
    m, rng = AcceptanceModel(), random.Random(0)
    for _ in range(3000):
        accepted = 1 if rng.random() < 0.4 else 0
        m.observe("eagle3", False, [0.85], verified=1, accepted=accepted)
    assert abs(m.estimate("eagle3", False, [0.85])[0] - 0.4) < 0.05
    # A bin without outcomes still moves: the position's observed / predicted ratio (0.4 / 0.85) scales it.
    assert abs(m.estimate("eagle3", False, [0.15])[0] - 0.15 * 0.4 / 0.85) < 0.01
    assert m.estimate("eagle3", True, [0.85]) == [0.85]  # greedy and sampled are kept apart
    assert m.estimate("dflash", False, [0.85]) == [0.85]  # and so are methods
    assert m.outcomes("eagle3", False, 1) <= m.window  # old outcomes fade


def test_labels_stop_one_past_the_last_accepted_draft():
    m = AcceptanceModel(prior_weight=1.0, ratio_weight=1e12)  # the bins alone
    m.observe("mtp", True, [0.5, 0.5, 0.5, 0.5], verified=4, accepted=2)
    assert [m.outcomes("mtp", True, k) for k in (1, 2, 3, 4)] == [1, 1, 1, 0]  # position 4 was never reached
    assert m.estimate("mtp", True, [0.5, 0.5, 0.5, 0.5]) == pytest.approx([0.75, 0.75, 0.25, 0.5])

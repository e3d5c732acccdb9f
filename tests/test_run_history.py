"""Run-time predictions from finished runs (`bot.domain.scheduling.RunHistory`)."""

from __future__ import annotations

import pytest

from bot.domain.scheduling import RunHistory


def test_nothing_finished_means_no_prediction() -> None:
    h = RunHistory()
    assert h.predict_duration("a", 1) is None
    assert h.predict_end("a", 1, 0.0, 100.0) is None


def test_the_prediction_is_conditioned_on_the_service_attained() -> None:
    h = RunHistory(min_own=2)
    for d in (60.0, 60.0, 600.0, 6000.0):
        h.add("b", 1, d)
    assert h.predict_duration("a", 1) == pytest.approx((60 + 60 + 600 + 6000) / 4)
    # past a minute only the two longer ones count: E[D - 60 | D > 60]
    assert h.expected_remaining("a", 1, 60.0) == pytest.approx((540 + 5940) / 2)
    # past every run seen: as long again as it has run (the doubling rule)
    assert h.expected_remaining("a", 1, 10_000.0) == pytest.approx(10_000.0)


def test_a_users_own_runs_of_that_size_win_when_there_are_enough() -> None:
    h = RunHistory(min_own=3)
    for _ in range(3):
        h.add("sweeper", 1, 100.0)
    for _ in range(10):
        h.add("trainer", 8, 80_000.0)
    assert h.predict_duration("sweeper", 1) == pytest.approx(100.0)
    assert h.predict_duration("trainer", 8) == pytest.approx(80_000.0)
    # too few of its own: everybody's
    assert h.predict_duration("sweeper", 8) == pytest.approx((300 + 800_000) / 13)


def test_the_predicted_end_steps_once_a_run_outlives_it() -> None:
    h = RunHistory(min_own=1)
    for d in (100.0, 1000.0):
        h.add("u", 1, d)
    t0 = h.predict_end("u", 1, 0.0, 0.0)
    assert t0 == pytest.approx(550.0)
    assert h.predict_end("u", 1, 0.0, 549.0) == t0  # unchanged until it passes
    assert h.predict_end("u", 1, 0.0, 551.0) == pytest.approx(1000.0)
    assert h.predict_end("u", 1, 0.0, 1001.0) == pytest.approx(2000.0)

"""Run-time predictions from finished runs (`bot.domain.scheduling.RunHistory`)."""

from __future__ import annotations

import random

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


@pytest.mark.parametrize("n", [0, 1, 7, 99, 100, 101, 250, 3_000])
def test_a_history_built_at_once_is_the_one_built_a_run_at_a_time(n: int) -> None:
    """`RunHistory.of` (the worker's: a month of runs at once) leaves exactly what adding
    them one by one leaves (the simulator's): the same visible samples and sums, the same
    pending ones, so the same predictions to the bit, at every count around a re-sort."""
    rng = random.Random(n)
    finished = [
        (rng.choice("abc"), rng.choice((1, 2, 8)), rng.choice((-5.0, 0.0, rng.expovariate(1e-3))))
        for _ in range(n)
    ]
    one_by_one = RunHistory()
    for user, gpus, d in finished:
        one_by_one.add(user, gpus, d)
    at_once = RunHistory.of(finished)
    for got, want in [(at_once.all, one_by_one.all)] + [
        (at_once.own[k], v) for k, v in one_by_one.own.items()
    ]:
        assert (got.sorted_s, got.prefix, got.pending) == (want.sorted_s, want.prefix, want.pending)
    assert at_once.own.keys() == one_by_one.own.keys()
    for user, gpus in [("a", 1), ("b", 8), ("c", 2), ("nobody", 4)]:
        assert list(at_once.stepped_ends(user, gpus)) == list(one_by_one.stepped_ends(user, gpus))
        for attained in (0.0, 30.0, 1_000.0, 1e6):
            assert at_once.expected_remaining(user, gpus, attained) == (
                one_by_one.expected_remaining(user, gpus, attained)
            )


def test_the_stepped_ends_are_the_chain_predict_end_walks() -> None:
    h = RunHistory(min_own=1)
    for d in (100.0, 200.0, 400.0, 5_000.0):
        h.add("a", 1, d)
    ends = list(h.stepped_ends("a", 1))
    assert ends[0] == pytest.approx(1_425.0) and ends == sorted(ends) and len(ends) == 64
    for now in (0.0, 1_424.0, 1_426.0, ends[5] + 1, ends[-1] + 1):
        first_after = next((e for e in ends if 10.0 + e > now), None)
        assert h.predict_end("a", 1, 10.0, now) == (
            None if first_after is None else 10.0 + first_after
        )

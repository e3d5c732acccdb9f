"""bot.domain.best_fit: the tightest hole that holds the request, the first one on a tie."""

from __future__ import annotations

from bot.domain.best_fit import best_fit


def test_the_tightest_hole_that_holds_the_request_wins() -> None:
    assert best_fit([("a", 8), ("b", 2), ("c", 4)], 2) == "b"
    assert best_fit([("a", 8), ("b", 2), ("c", 4)], 3) == "c"


def test_a_hole_too_small_is_never_chosen() -> None:
    assert best_fit([("a", 1), ("b", 3)], 4) is None
    assert best_fit([], 1) is None


def test_on_a_tie_the_first_place_wins() -> None:
    assert best_fit([("a", 8), ("b", 4), ("c", 4)], 4) == "b"
    assert best_fit([("c", 4), ("b", 4)], 1) == "c"


def test_it_takes_any_iterable_once() -> None:
    free = {"x": 3, "y": 5}
    assert best_fit(((k, n) for k, n in free.items()), 3) == "x"

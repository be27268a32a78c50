"""The benchmarks' verdict rule (benchmarks/verdicts.py): a sign test, not "all rounds on one side"."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import verdicts  # noqa: E402


def test_sign_test_p_matches_the_binomial_tails():
    assert verdicts.sign_test_p(6, 6) == 2 / 64
    assert verdicts.sign_test_p(0, 6) == 2 / 64
    assert abs(verdicts.sign_test_p(8, 9) - 2 * 10 / 512) < 1e-12
    assert verdicts.sign_test_p(3, 6) == 1.0


def test_three_rounds_on_one_side_are_not_decided():
    assert verdicts.verdict([0.90, 0.91, 0.92], 1.0) == "undecided (3 rounds)"
    assert verdicts.verdict([0.9] * 5, 1.0).startswith("undecided")


def test_six_of_six_below_is_decided_and_a_mixed_set_is_noise():
    assert verdicts.verdict([0.90, 0.91, 0.92, 0.95, 0.97, 0.99], 1.0) == "decided"
    assert verdicts.verdict([0.909, 0.95, 0.963, 0.972, 0.985, 0.987, 1.016, 1.032, 1.053], 1.0) == "within noise"
    assert verdicts.verdict([1.1] * 8 + [0.9], 1.0) == "decided"  # 8 of 9
    assert verdicts.verdict([1.1] * 7 + [0.9] * 2, 1.0) == "within noise"  # 7 of 9: p = 0.18


def test_ties_are_left_out_and_none_is_reported():
    assert verdicts.verdict([1.0] * 3 + [1.2] * 6, 1.0) == "decided"
    assert verdicts.verdict([0.5], None) == "reported"


def test_median_interval_covers_at_least_the_confidence_asked():
    lo, hi, cover = verdicts.median_interval([5, 1, 4, 2, 3, 9, 7, 8, 6], 0.90)
    assert (lo, hi) == (2, 8) and 0.96 < cover < 0.97  # j = 2; j = 3 covers only 0.82
    assert verdicts.median_interval([2.0, 1.0]) == (1.0, 2.0, 0.0)

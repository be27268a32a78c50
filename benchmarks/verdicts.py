"""Is a benchmark figure above or below its target, or within the machine's noise? (the sign test)

Each benchmark here alternates rounds of distnb and its reference and gets one ratio per round
(reference time / distnb time, or distnb rate / reference rate). On a shared 2-core machine one
run of the same process can differ from the next by 20 %, so a median alone does not say which
side of a target a figure is on. The rule used by every benchmark that says "decided":

- ties (a round exactly at the target) are left out, as the sign test does;
- the figure is **decided** when the two-sided sign test (binomial, p = 1/2) rejects "a round is
  as likely above the target as below it" at ``alpha`` = 0.05: at least 6 of 6, 7 of 7, 8 of 9
  or 9 of 10 rounds on one side (Dixon & Mood, "The statistical sign test", JASA 1946);
- otherwise **within noise**: the median's side of the target is what the rounds say, not decided.

Fewer than 6 rounds can never be decided at 5 %; the earlier rule ("3 rounds all on one side")
called a coin's 1-in-4 chance decided.
"""

from __future__ import annotations

from math import comb

ALPHA = 0.05


def sign_test_p(above: int, rounds: int) -> float:
    """Two-sided sign test p-value for ``above`` of ``rounds`` (ties already left out) on one side."""
    if rounds <= 0:
        return 1.0
    k = max(above, rounds - above)
    tail = sum(comb(rounds, i) for i in range(k, rounds + 1)) / 2 ** rounds
    return min(1.0, 2 * tail)


def median_interval(values, confidence: float = 0.90) -> tuple:
    """A distribution-free interval for the median: the order statistics (x_(j), x_(n+1-j)).

    ``j`` is the largest for which the binomial coverage is at least ``confidence``; with fewer than
    3 values the interval is (min, max). Returns (low, high, coverage).
    """
    xs = sorted(values)
    n = len(xs)
    if n < 3:
        return (xs[0], xs[-1], 0.0) if xs else (float("nan"), float("nan"), 0.0)
    best = (xs[0], xs[-1], 1 - 2 / 2 ** n)
    for j in range(1, n // 2 + 1):  # P(x_(j) <= median <= x_(n+1-j)) = 1 - 2 P(Bin(n, 1/2) <= j - 1)
        coverage = 1 - 2 * sum(comb(n, i) for i in range(j)) / 2 ** n
        if coverage < confidence:
            break
        best = (xs[j - 1], xs[n - j], coverage)
    return best


def verdict(ratios, target, alpha: float = ALPHA) -> str:
    """``"decided"``, ``"within noise"``, ``"undecided (N rounds)"`` (too few to ever decide) or ``"reported"``.

    ``ratios``: one per round, higher is better for distnb; ``target``: the bound it is judged
    against, None for a figure that is only reported.
    """
    if target is None:
        return "reported"
    off = [r for r in ratios if r != target]
    if sign_test_p(0, len(off)) > alpha:  # even every round on one side would not decide
        return f"undecided ({len(ratios)} round{'s' if len(ratios) != 1 else ''})"
    above = sum(r > target for r in off)
    return "decided" if sign_test_p(above, len(off)) <= alpha else "within noise"


def decided(ratios, target, alpha: float = ALPHA) -> bool:
    """True when :func:`verdict` says "decided"."""
    return verdict(ratios, target, alpha) == "decided"

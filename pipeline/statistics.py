"""Statistics for the arms comparison, on scipy.stats: differences between arms and the tests behind them.

Two kinds of noise, each with its own test:
- **Training noise (seeds).** Seeds are few (3 in the paper), so a difference between arms over seeds uses
  Student's t: a 95 % confidence interval and a two-sided p-value for the Prism − uniform difference, paired by
  seed when both arms ran the same seeds on the same data order (the difference per seed cancels the
  data-order noise), Welch's unequal-variance test otherwise. `seeds_needed` answers "how many seeds would this
  effect and this noise need": the smallest n at which a two-sided test at level alpha detects the observed
  mean difference with the given power.
- **Evaluation noise (items, sequences).** Both arms answer the same benchmark items and score the same
  validation sequences, so a difference can be paired item by item: `mcnemar` (exact, on the items one arm
  got right and the other wrong), `paired_bootstrap` (items resampled, and seed pairs too when there are
  several), `paired_difference` over sequences. `two_proportion_test` is what a test on the two accuracies
  alone would say, for contrast: it ignores the pairing, so it needs a much larger difference.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from scipy import stats
from threadpoolctl import ThreadpoolController

NAN = float("nan")


@cache
def _blas() -> ThreadpoolController:
    return ThreadpoolController()


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """OpenBLAS held to one thread: the small products and L-BFGS-B steps here cost far more threaded on a busy
    machine (the threads' hand-offs outweigh matrices this small)."""
    with _blas().limit(limits=1, user_api="blas"):
        yield


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std (ddof=1); std is nan for fewer than two values, both nan for none."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return NAN, NAN
    mean = float(x.mean())
    if x.size < 2:
        return mean, NAN
    return mean, float(x.std(ddof=1))


# --- the difference between two arms -------------------------------------------------------------------
@dataclass(frozen=True)
class Difference:
    """mean(b) − mean(a) with its standard error, df, interval (at the level asked, 95 % by default) and
    two-sided p-value. ``method`` names the test: "paired" (t over pairs: seeds, or sequences), "welch" (t
    for two independent groups) or "paired bootstrap" (df is nan there)."""

    method: str
    n: int  # pairs (paired), the smaller group size (welch), items (paired bootstrap)
    mean: float
    se: float
    df: float
    low: float
    high: float
    p_value: float

    @property
    def defined(self) -> bool:
        return not math.isnan(self.p_value)


def difference_columns(diff: Difference | None) -> dict[str, float | str]:
    """A Δ's columns in the comparison tables and CSVs (nan and "" where no difference was computed)."""
    nan = float("nan")
    return {
        "delta_vs_uniform": diff.mean if diff else nan,
        "delta_ci95_low": diff.low if diff else nan,
        "delta_ci95_high": diff.high if diff else nan,
        "delta_p_value": diff.p_value if diff else nan,
        "delta_test": diff.method if diff else "",
    }


def difference_cells(row: dict[str, Any]) -> tuple[str, str]:
    """A table row's 'Δ [95 % CI]' and 'p (test)' cells from its difference_columns; blank where no Δ."""
    delta, low = row["delta_vs_uniform"], row["delta_ci95_low"]
    if math.isnan(delta):
        return "", ""
    if math.isnan(low):
        return f"{delta:+.4f} [needs ≥ 2 seeds]", ""
    return (
        f"{delta:+.4f} [{low:+.4f}, {row['delta_ci95_high']:+.4f}]",
        f"{row['delta_p_value']:.3f} ({row['delta_test']})",
    )


def _from_t(method: str, n: int, mean: float, se: float, df: float, level: float) -> Difference:
    if not (se > 0 and df > 0):  # one seed, or identical values: no interval
        return Difference(method, n, mean, se if se == se else NAN, df, NAN, NAN, NAN)
    half = float(stats.t.ppf(0.5 + level / 2.0, df)) * se
    p = 2.0 * float(stats.t.cdf(-abs(mean / se), df))
    return Difference(method, n, mean, se, df, mean - half, mean + half, p)


def paired_difference(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Difference:
    """b − a over pairs (a[i], b[i]): the one-sample t-test of the per-pair differences.

    Pairs are seeds (training noise) or, for one pair of runs, the validation sequences both arms scored (the
    interval then measures which sequences the validation set happens to hold, not training noise)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length ({len(a)} vs {len(b)})")
    diffs = np.asarray(b, dtype=float) - np.asarray(a, dtype=float)
    mean, std = mean_std(diffs)
    n = len(diffs)
    return _from_t("paired", n, mean, std / math.sqrt(n) if n > 1 else NAN, n - 1, level)


def welch_difference(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Difference:
    """mean(b) − mean(a) for independent samples with unequal variances (Welch–Satterthwaite df)."""
    (ma, sa), (mb, sb) = mean_std(a), mean_std(b)
    na, nb = len(a), len(b)
    if na < 2 or nb < 2:
        return _from_t("welch", min(na, nb), mb - ma, NAN, NAN, level)
    va, vb = sa * sa / na, sb * sb / nb
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va * va / (na - 1) + vb * vb / (nb - 1)) if va + vb > 0 else NAN
    return _from_t("welch", min(na, nb), mb - ma, se, df, level)


def seeds_needed(
    effect: float, noise_sd: float, paired: bool, alpha: float = 0.05, power: float = 0.8, cap: int = 1000
) -> int | None:
    """Smallest seed count n at which a two-sided t-test at ``alpha`` finds ``effect`` with ``power``.

    ``noise_sd`` is the std of the per-seed differences (paired) or the pooled per-run std (two groups of
    n seeds each). Uses the normal approximation of the noncentral t: n = ((t_{1-α/2} + t_{power}) · sd / δ)²
    times 2 for two groups, iterated because the t quantiles depend on n. None if undefined (no noise
    estimate or no effect); ``cap`` + 1 means "more than cap".
    """
    if not (noise_sd > 0 and effect == effect and effect != 0 and noise_sd == noise_sd):
        return None
    groups = 1 if paired else 2
    n = np.arange(2, cap + 1)
    df = n - 1 if paired else 2 * n - 2
    z = stats.t.ppf(1 - alpha / 2, df) + stats.t.ppf(power, df)
    enough = np.flatnonzero(n >= groups * (z * noise_sd / abs(effect)) ** 2)
    return int(n[enough[0]]) if enough.size else cap + 1


def mean_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): Student's t interval of the mean; low and high are nan for fewer than two values."""
    mean, std = mean_std(values)
    if len(values) < 2:
        return mean, NAN, NAN
    half = float(stats.t.ppf(0.5 + level / 2.0, len(values) - 1)) * std / math.sqrt(len(values))
    return mean, mean - half, mean + half


# --- item-paired tests: both arms scored on the same items ---------------------------------------------
def mcnemar(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value from the discordant counts of one seed pair scored on the same items.

    ``b``: items only arm A got right; ``c``: items only arm B got right (items both got right or both got wrong
    say nothing about the difference). Under "no difference" each discordant item is a fair coin, so the
    p-value is the two-sided binomial test of b out of b + c at 1/2. 1.0 when there is no discordant item.
    It measures evaluation noise only (which items the benchmark holds), for these two trained models."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0 (got b={b}, c={c})")
    if b + c == 0:
        return 1.0
    return float(stats.binomtest(int(b), int(b + c), 0.5).pvalue)


def two_proportion_test(correct_a: int, correct_b: int, n: int) -> float:
    """Two-sided p-value of the unpaired test on two accuracies over ``n`` items each: Pearson's chi-square on
    the 2x2 table (right/wrong by arm, no continuity correction; the same p as the pooled two-proportion z
    test). It is what the two accuracies alone can tell, as if the arms had answered different items: the
    contrast that shows what pairing by item buys. 1.0 when every item got the same answer in both arms."""
    if n <= 0 or not (0 <= correct_a <= n and 0 <= correct_b <= n):
        raise ValueError(f"correct counts must lie in 0..n (got {correct_a}, {correct_b} of n={n})")
    right = correct_a + correct_b
    if right in (0, 2 * n):  # a column of zeros: no variance, no evidence of a difference
        return 1.0
    table = [[correct_a, n - correct_a], [correct_b, n - correct_b]]
    return float(stats.chi2_contingency(table, correction=False).pvalue)


def paired_bootstrap(a: np.ndarray, b: np.ndarray, level: float = 0.95, iters: int = 2000, seed: int = 0) -> Difference:
    """Δ = mean(b − a) over items, averaged over seed pairs, with a percentile bootstrap interval.

    ``a``, ``b``: float arrays of shape (pairs, items) (a 1-D array is one pair); row i of ``a`` and row i of
    ``b`` are one seed pair scored on the same items in the same order (0/1 correctness, or a continuous
    score such as bits per byte). Each replicate resamples the items (one draw shared by all pairs, so the
    pairing by item holds) and, when pairs > 1, the pairs too: the interval measures evaluation noise (which
    items the benchmark holds) and, with several pairs, training noise (which seeds were run) as well.

    Returns a Difference with method "paired bootstrap", n = items, mean = Δ, se = the replicates' std,
    df = nan, low/high = the replicates' percentiles at (1 ∓ level)/2, and p_value = an approximate two-sided
    bootstrap p: twice the share of replicates on the other side of 0 from Δ, capped at 1 and floored at
    1/iters (the bootstrap cannot resolve smaller p). Vectorized: each replicate's Δ is the per-pair item sums
    weighted by how often each item (and pair) was drawn."""
    a2, b2 = np.atleast_2d(np.asarray(a, dtype=float)), np.atleast_2d(np.asarray(b, dtype=float))
    if a2.shape != b2.shape or a2.ndim != 2:
        raise ValueError(f"paired arrays must have one shape (pairs, items) (got {a2.shape} vs {b2.shape})")
    pairs, items = a2.shape
    if items == 0:
        raise ValueError("paired_bootstrap needs at least one item")
    if not (np.isfinite(a2).all() and np.isfinite(b2).all()):
        raise ValueError("paired scores must be finite (an item without a score has no pair: leave it out of both)")
    diff = b2 - a2
    mean = float(diff.mean())
    rng = np.random.default_rng(seed)
    replicates = np.empty(iters)
    chunk = max(1, 4_000_000 // items)  # bounds the (chunk, items) count matrix to ~32 MB
    for start in range(0, iters, chunk):
        size = min(chunk, iters - start)
        drawn = rng.integers(0, items, size=(size, items)) + items * np.arange(size)[:, None]
        counts = np.bincount(drawn.ravel(), minlength=size * items).reshape(size, items)
        with one_blas_thread():
            sums = counts @ diff.T  # (size, pairs): each pair's item sum under this item draw
        if pairs > 1:
            picks = rng.integers(0, pairs, size=(size, pairs)) + pairs * np.arange(size)[:, None]
            weights = np.bincount(picks.ravel(), minlength=size * pairs).reshape(size, pairs)
            sums = sums * weights
        replicates[start : start + size] = sums.sum(axis=1) / (pairs * items)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(replicates, [tail, 1.0 - tail])
    other_side = np.mean(replicates <= 0) if mean > 0 else np.mean(replicates >= 0) if mean < 0 else 1.0
    p = min(1.0, max(2.0 * float(other_side), 1.0 / iters))
    se = float(replicates.std(ddof=1)) if iters > 1 else NAN
    return Difference("paired bootstrap", items, mean, se, NAN, float(low), float(high), p)

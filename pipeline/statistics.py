"""Small-sample statistics for the arms comparison, pure Python (no scipy at run time; tests check against it).

Seeds are few (3 in the paper), so everything uses Student's t: a 95 % confidence interval and a two-sided
p-value for the Prism − uniform difference, paired by seed when both arms ran the same seeds on the same
data order (the difference per seed cancels the data-order noise), Welch's unequal-variance test otherwise.
`seeds_needed` answers "how many seeds would this effect and this noise need": the smallest n at which a
two-sided test at level alpha detects the observed mean difference with the given power.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

NAN = float("nan")


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std (ddof=1); std is nan for fewer than two values, both nan for none."""
    n = len(values)
    if n == 0:
        return NAN, NAN
    mean = sum(values) / n
    if n < 2:
        return mean, NAN
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


# --- Student's t through the regularized incomplete beta function ---------------------------------------
def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """Continued fraction of I_x(a, b), evaluated with the modified Lentz method."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return result


def incomplete_beta(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) for a, b > 0, 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side; use the symmetry otherwise
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df degrees of freedom (df may be fractional, as in Welch's test)."""
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with t_cdf(t, df) = p, by bisection (monotone, so robust for any df > 0)."""
    lo, hi = -1e6, 1e6
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


# --- the difference between two arms -------------------------------------------------------------------
@dataclass(frozen=True)
class Difference:
    """mean(b) − mean(a) with its standard error, t, df, 95 % CI and two-sided p-value."""

    method: str  # "paired" (by seed) or "welch"
    n: int  # pairs (paired) or the smaller group size (welch)
    mean: float
    se: float
    df: float
    low: float
    high: float
    p_value: float

    @property
    def defined(self) -> bool:
        return not math.isnan(self.p_value)


def _from_t(method: str, n: int, mean: float, se: float, df: float, level: float) -> Difference:
    if not (se > 0 and df > 0):  # one seed, or identical values: no interval
        return Difference(method, n, mean, se if se == se else NAN, df, NAN, NAN, NAN)
    half = t_quantile(0.5 + level / 2.0, df) * se
    p = 2.0 * t_cdf(-abs(mean / se), df)
    return Difference(method, n, mean, se, df, mean - half, mean + half, p)


def paired_difference(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Difference:
    """b − a over pairs (a[i], b[i]): the one-sample t-test of the per-pair differences."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length ({len(a)} vs {len(b)})")
    diffs = [y - x for x, y in zip(a, b)]
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
    n = 2
    while n <= cap:
        df = n - 1 if paired else 2 * n - 2
        z = t_quantile(1 - alpha / 2, df) + t_quantile(power, df)
        if n >= groups * (z * noise_sd / abs(effect)) ** 2:
            return n
        n += 1
    return cap + 1


def mean_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): Student's t interval of the mean; low and high are nan for fewer than two values."""
    mean, std = mean_std(values)
    if len(values) < 2:
        return mean, NAN, NAN
    half = t_quantile(0.5 + level / 2.0, len(values) - 1) * std / math.sqrt(len(values))
    return mean, mean - half, mean + half

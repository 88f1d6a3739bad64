"""pipeline.statistics against scipy (the reference) and closed forms."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from pipeline import statistics as st


@pytest.mark.parametrize("df", [1, 2, 2.7, 5, 30])
@pytest.mark.parametrize("t", [-4.0, -1.3, 0.0, 0.4, 2.5])
def test_t_cdf_and_quantile_match_scipy(t, df):
    assert st.t_cdf(t, df) == pytest.approx(stats.t.cdf(t, df), abs=1e-10)
    p = stats.t.cdf(t, df)
    assert st.t_quantile(p, df) == pytest.approx(t, abs=1e-6)


def test_t_with_one_df_is_cauchy_closed_form():
    for t in (-3.0, 0.5, 7.0):
        assert st.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)


def test_paired_difference_matches_scipy_ttest_rel_and_its_interval():
    uniform = [3.3748, 3.3721, 3.3775]
    prism = [3.3604, 3.3611, 3.3595]
    d = st.paired_difference(uniform, prism)
    ref = stats.ttest_rel(prism, uniform)
    assert d.method == "paired" and d.n == 3 and d.df == 2
    assert d.mean == pytest.approx(sum(p - u for u, p in zip(uniform, prism)) / 3)
    assert d.p_value == pytest.approx(ref.pvalue, rel=1e-8)
    lo, hi = ref.confidence_interval(0.95)
    assert (d.low, d.high) == (pytest.approx(lo, abs=1e-9), pytest.approx(hi, abs=1e-9))


def test_welch_difference_matches_scipy_ttest_ind_unequal_var():
    a, b = [5.81, 5.86, 5.79, 5.90], [5.97, 5.70, 6.02]
    d = st.welch_difference(a, b)
    ref = stats.ttest_ind(b, a, equal_var=False)
    assert d.method == "welch"
    assert d.mean / d.se == pytest.approx(ref.statistic, rel=1e-10)
    assert d.df == pytest.approx(ref.df, rel=1e-10)
    assert d.p_value == pytest.approx(ref.pvalue, rel=1e-8)
    lo, hi = ref.confidence_interval(0.95)
    assert (d.low, d.high) == (pytest.approx(lo, abs=1e-9), pytest.approx(hi, abs=1e-9))


def test_one_seed_gives_a_difference_without_interval():
    d = st.paired_difference([5.8], [5.9])
    assert d.mean == pytest.approx(0.1) and not d.defined and math.isnan(d.low)
    assert not st.welch_difference([5.8], [5.9, 6.0]).defined


def test_mean_std_is_sample_std():
    assert st.mean_std([1.0, 2.0, 4.0]) == (pytest.approx(7 / 3), pytest.approx(stats.tstd([1.0, 2.0, 4.0])))
    assert math.isnan(st.mean_std([1.0])[1])


def test_seeds_needed_reaches_the_requested_power_and_grows_with_noise():
    effect, sd = 0.01, 0.01
    n = st.seeds_needed(effect, sd, paired=True)

    # exact power of the paired t-test at n and n-1 seeds, from scipy's noncentral t
    def power(k):
        crit = stats.t.ppf(0.975, k - 1)
        nc = effect / (sd / math.sqrt(k))
        return 1 - stats.nct.cdf(crit, k - 1, nc) + stats.nct.cdf(-crit, k - 1, nc)

    assert power(n) >= 0.78 and power(n - 1) < 0.8
    assert st.seeds_needed(effect, 2 * sd, paired=True) > n
    assert st.seeds_needed(effect, sd, paired=False) > n  # two independent groups need more
    assert st.seeds_needed(0.0, sd, paired=True) is None and st.seeds_needed(effect, math.nan, paired=True) is None
    assert st.seeds_needed(1e-6, 1.0, paired=True, cap=50) == 51


def test_mean_interval_matches_scipy_t_interval():
    values = [0.31, 0.29, 0.35]
    mean, low, high = st.mean_interval(values)
    want = stats.t.interval(0.95, len(values) - 1, loc=sum(values) / 3, scale=stats.sem(values))
    assert mean == pytest.approx(sum(values) / 3) and (low, high) == pytest.approx(want)
    one = st.mean_interval([0.3])
    assert one[0] == 0.3 and math.isnan(one[1]) and math.isnan(one[2])

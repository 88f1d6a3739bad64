"""pipeline.statistics: the seed-level t tests against scipy's own tests (the reference), and the item-paired
tests on fixtures where pairing matters."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from pipeline import statistics as st


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


def two_arms_on_2000_items(both=920, only_a=85, only_b=115):
    """Per-item 0/1 correctness of one seed pair: B gets 30 more of 2,000 items right (1.5 points), with 10 %
    of the items discordant (one arm right, the other wrong), in a shuffled item order."""
    a = np.repeat([1.0, 1.0, 0.0, 0.0], [both, only_a, only_b, 2000 - both - only_a - only_b])
    b = np.repeat([1.0, 0.0, 1.0, 0.0], [both, only_a, only_b, 2000 - both - only_a - only_b])
    order = np.random.default_rng(7).permutation(2000)
    return a[order], b[order]


def test_pairing_by_item_finds_a_gain_the_two_accuracies_alone_cannot():
    a, b = two_arms_on_2000_items()
    assert b.sum() - a.sum() == 30
    assert st.mcnemar(85, 115) < 0.05
    assert st.two_proportion_test(int(a.sum()), int(b.sum()), 2000) > 0.05
    d = st.paired_bootstrap(a, b)
    assert d.method == "paired bootstrap" and d.n == 2000 and d.mean == pytest.approx(0.015)
    assert 0 < d.low < d.mean < d.high and d.p_value < 0.05
    # the same scores with B's items shuffled (the pairing lost) no longer exclude 0
    unpaired = st.paired_bootstrap(a, np.random.default_rng(3).permutation(b))
    assert unpaired.low < 0 < unpaired.high and unpaired.high - unpaired.low > 2 * (d.high - d.low)


def test_mcnemar_counts_only_discordant_items_and_is_symmetric():
    assert st.mcnemar(0, 0) == 1.0
    assert st.mcnemar(10, 25) == pytest.approx(st.mcnemar(25, 10))
    assert st.mcnemar(10, 25) < st.mcnemar(15, 20) < 1.0
    with pytest.raises(ValueError, match="discordant counts"):
        st.mcnemar(-1, 3)


def test_two_proportion_test_without_variance_and_out_of_range_counts():
    assert st.two_proportion_test(2000, 2000, 2000) == 1.0 and st.two_proportion_test(0, 0, 10) == 1.0
    assert st.two_proportion_test(100, 160, 200) < 1e-6
    with pytest.raises(ValueError, match="0..n"):
        st.two_proportion_test(201, 150, 200)


def test_paired_bootstrap_widens_when_seed_pairs_disagree():
    """Three seed pairs with the same mean Δ: the interval is wider when the pairs' own Δ differ (training noise
    joins evaluation noise) than when they agree."""
    rng = np.random.default_rng(0)
    a = (rng.random((3, 3000)) < 0.5).astype(float)
    flips = rng.random((3, 3000))
    agree = np.where(flips < 0.03, 1.0, a)  # each pair gains about the same
    disagree = np.where(flips < np.array([[0.0], [0.03], [0.06]]), 1.0, a)  # gains of 0, ~1.5 and ~3 points
    narrow, wide = st.paired_bootstrap(a, agree, iters=1000), st.paired_bootstrap(a, disagree, iters=1000)
    assert narrow.mean == pytest.approx((agree - a).mean()) and wide.mean == pytest.approx((disagree - a).mean())
    assert wide.high - wide.low > 1.3 * (narrow.high - narrow.low)
    one_pair = st.paired_bootstrap(a[0], agree[0], iters=500)
    assert one_pair.n == 3000 and one_pair.p_value == pytest.approx(1 / 500)  # floored: no replicate crosses 0
    with pytest.raises(ValueError, match="one shape"):
        st.paired_bootstrap(a, agree[:2])
    with pytest.raises(ValueError, match="finite"):
        st.paired_bootstrap([0.5, np.nan], [0.4, 0.6])


def test_paired_difference_over_sequences_equals_scipy_on_a_long_sample():
    rng = np.random.default_rng(1)
    uniform = rng.normal(3.4, 0.3, size=50_000)
    prism = uniform + rng.normal(-0.002, 0.05, size=50_000)
    d = st.paired_difference(uniform.tolist(), prism.tolist())
    ref = stats.ttest_rel(prism, uniform)
    assert d.n == 50_000 and d.p_value == pytest.approx(ref.pvalue, rel=1e-6)

"""pipeline.verdict.fits on synthetic runs drawn from known power laws: the fits recover the exponents, the
compute multiplier has its closed form, and the verdict's intervals cover the truth (the 100-replicate coverage
check is tests/integration/test_fits_coverage.py: it takes ~30 s)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.verdict.fits import PowerLaw, compute_multiplier, fit_power_law, scaling_verdict

SIZES = np.geomspace(1e5, 1e9, 6)
# Realistic magnitudes: losses from ~4.9 nats at 1e5 parameters down to ~1.9 at 1e9.
UNIFORM = PowerLaw(E=1.7, A=100.0, alpha=0.3)
PRISM = PowerLaw(E=1.7, A=94.0, alpha=0.3)  # 6 % less reducible loss: k = (100/94)^(2/0.3) ≈ 1.51 at every N
TRUE_K = (100.0 / 94.0) ** (2 / 0.3)


def noisy(law: PowerLaw, N, D=None, sd=0.003, seed=0):
    """Losses off the law by a multiplicative seed noise of ``sd`` (0.3 %: ~0.01 nats at L = 3)."""
    return law.loss(N, D) * np.exp(np.random.default_rng(seed).normal(0.0, sd, np.shape(N)))


def runs(sizes=SIZES[:4], seeds=3, sd=0.003, seed=0, tokens_per_param=(20.0,), speeds=(1000.0, 950.0), laws=None):
    """The points scaling_verdict reads: both arms, each size and seed, one point per token count."""
    rng = np.random.default_rng(seed)
    points = []
    for (arm, law), speed in zip(zip(("uniform", "prism"), laws or (UNIFORM, PRISM)), speeds):
        for N in sizes:
            for s in range(seeds):
                for tpp in tokens_per_param:
                    loss = law.loss(N, None if law.beta is None else tpp * N) * math.exp(rng.normal(0.0, sd))
                    points.append(
                        {
                            "arm": arm,
                            "N": N,
                            "D": tpp * N,
                            "loss": loss,
                            "seed": str(s),
                            "tokens_per_sec": speed * 1e6 / N,
                        }
                    )
    return points


@pytest.mark.parametrize("seed", [0, 1])
def test_fit_recovers_the_exponent_of_L_of_N(seed):
    N = np.repeat(SIZES, 3)  # 6 sizes x 3 seeds
    fit = fit_power_law(N, noisy(UNIFORM, N, seed=seed))
    assert fit.beta is None and fit.alpha == pytest.approx(UNIFORM.alpha, rel=0.1)
    assert fit.loss(SIZES) == pytest.approx(UNIFORM.loss(SIZES), rel=0.005)


def test_fit_recovers_both_exponents_of_L_of_N_and_D():
    law = PowerLaw(E=1.7, A=100.0, alpha=0.3, B=60.0, beta=0.28)
    N, tpp = np.meshgrid(SIZES[:5], [5.0, 20.0, 80.0])  # 5 sizes, 3 token counts each (milestones)
    N, D = N.ravel(), (tpp * N).ravel()
    assert 2.0 < law.loss(N, D).min() and law.loss(N, D).max() < 6.5
    fit = fit_power_law(N, noisy(law, N, D), D)
    assert fit.alpha == pytest.approx(law.alpha, rel=0.1) and fit.beta == pytest.approx(law.beta, rel=0.1)


def test_one_diverged_run_bends_the_robust_fit_little():
    N = np.repeat(SIZES, 3)
    loss = noisy(UNIFORM, N, seed=2)
    loss[16] *= 1.3  # one run of the largest size ended 30 % high
    fit = fit_power_law(N, loss)
    assert fit.alpha == pytest.approx(UNIFORM.alpha, rel=0.05)  # least squares: α = 0.348, 16 % off


def test_too_few_sizes_or_points_are_refused_with_the_count():
    with pytest.raises(ValueError, match="at least 3 distinct model sizes N; got 2"):
        fit_power_law([1e6, 1e6, 1e7, 1e7], [3.0, 3.1, 2.5, 2.6])
    with pytest.raises(ValueError, match="got 4 points, 2 distinct N, 2 distinct D"):
        fit_power_law([1e6, 1e6, 1e7, 1e7], [3.0, 2.9, 2.5, 2.4], D=[1e8, 2e8, 1e8, 2e8])
    with pytest.raises(ValueError, match="finite and positive"):
        fit_power_law([1e6, 1e7, 1e8], [3.0, math.nan, 2.0])


def test_compute_multiplier_has_the_closed_form_and_its_limits():
    assert compute_multiplier(UNIFORM, PRISM, SIZES) == pytest.approx(np.full(6, TRUE_K))
    assert compute_multiplier(PRISM, UNIFORM, [1e6])[0] == pytest.approx(1 / TRUE_K)  # uniform better: k < 1
    below_reach = PowerLaw(E=1.5, A=94.0, alpha=0.3)  # at large N Prism goes below uniform's E
    assert compute_multiplier(UNIFORM, below_reach, [1e6, 1e12])[1] == math.inf
    # the 2-D form, at D = 20 N: both reducible terms 6 % lower with equal exponents give the same k
    u2, p2 = PowerLaw(1.7, 100.0, 0.3, 300.0, 0.3), PowerLaw(1.7, 94.0, 0.3, 282.0, 0.3)
    assert compute_multiplier(u2, p2, [1e6, 1e8], tokens_per_param=20.0) == pytest.approx([TRUE_K, TRUE_K])
    with pytest.raises(ValueError, match="tokens_per_param"):
        compute_multiplier(u2, p2, [1e6])
    with pytest.raises(ValueError, match="one form"):
        compute_multiplier(UNIFORM, p2, [1e6])


def test_verdict_intervals_cover_the_truth_and_name_the_form():
    verdict = scaling_verdict(runs(seed=3), boot=100)
    assert verdict["form"] == "L(N)" and verdict["tokens_per_param"] == 20.0 and verdict["min_seeds"] == 3
    assert [row["N"] for row in verdict["rows"]] == pytest.approx(SIZES[:4])
    for row in verdict["rows"]:
        true_gap = PRISM.loss(row["N"]) - UNIFORM.loss(row["N"])
        assert row["gap_low"] <= true_gap <= row["gap_high"] and row["gap_low"] < row["gap"] < row["gap_high"]
        assert row["k_low"] <= TRUE_K <= row["k_high"] and row["k_low"] < row["k"] < row["k_high"]
        assert row["k_time"] == pytest.approx(0.95 * row["k"])  # Prism trains at 95 % of uniform's tokens/s
        assert row["loss_prism"] - row["loss_uniform"] == pytest.approx(row["gap"])
    # twice the seed noise, twice the interval (about): the bootstrap measures the seeds' spread
    noisier = scaling_verdict(runs(seed=3, sd=0.006), boot=100)["rows"][1]
    row = verdict["rows"][1]
    assert 1.5 < (noisier["k_high"] - noisier["k_low"]) / (row["k_high"] - row["k_low"]) < 2.5


def test_one_seed_per_size_gives_no_interval_and_no_tokens_per_sec_no_k_time():
    points = runs(seeds=1, speeds=(math.nan, math.nan))
    row = scaling_verdict(points)["rows"][1]
    assert row["k"] > 1 and math.isnan(row["k_low"]) and math.isnan(row["gap_high"]) and math.isnan(row["k_time"])


def test_several_token_counts_per_size_select_the_two_dimensional_form():
    laws = (PowerLaw(1.7, 100.0, 0.3, 60.0, 0.28), PowerLaw(1.7, 94.0, 0.3, 56.4, 0.28))
    points = runs(seeds=1, tokens_per_param=(10.0, 20.0, 40.0), sizes=SIZES[:3], laws=laws)
    verdict = scaling_verdict(points, N_grid=[1e6], boot=0, starts=2)
    assert verdict["form"] == "L(N,D)" and verdict["tokens_per_param"] == 20.0
    assert verdict["fits"]["prism"].beta == pytest.approx(0.28, rel=0.1)
    want = compute_multiplier(*laws, [1e6], tokens_per_param=20.0)[0]
    assert verdict["rows"][0]["k"] == pytest.approx(want, rel=0.2)


def test_the_verdict_refuses_a_missing_arm_or_too_few_sizes():
    with pytest.raises(ValueError, match="no prism run"):
        scaling_verdict([p for p in runs() if p["arm"] == "uniform"])
    with pytest.raises(ValueError, match="uniform arm: the L.N. fit needs at least 3 distinct model sizes N; got 2"):
        scaling_verdict(runs(sizes=SIZES[:2]))

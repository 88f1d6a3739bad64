"""The scaling verdict's 95 % interval of k covers the true k in at least 90 of 100 seeded replicates.

In tests/integration, not tests/unit: 100 verdicts (each two fits and 2 x 200 bootstrap refits) take ~30 s of
CPU, over the unit suite's budget; tests/unit/test_fits.py checks one replicate's intervals."""

from __future__ import annotations

import numpy as np

from pipeline.verdict.fits import scaling_verdict
from tests.unit.test_fits import TRUE_K, runs


def test_the_interval_of_k_covers_the_true_k_in_90_of_100_replicates():
    """Each replicate: 4 sizes (1e5 to 1.6e7 parameters) x 3 seeds per arm, 0.3 % seed noise in the loss, the
    default 200 bootstrap replicates. Coverage is counted at each size."""
    covered = np.zeros(4, dtype=int)
    for replicate in range(100):
        rows = scaling_verdict(runs(seed=1000 + replicate))["rows"]
        covered += [row["k_low"] <= TRUE_K <= row["k_high"] for row in rows]
    assert (covered >= 90).all(), f"covered the true k in {covered.tolist()} of 100 replicates (per size)"

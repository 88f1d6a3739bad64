"""Scaling fits for the two arms, and the compute multiplier between them (torch-free, scipy.optimize).

Per arm, the final validation loss against model size N (parameters) is fitted by L(N) = E + A·N^−α at the
study's tokens per parameter, or by L(N, D) = E + A·N^−α + B·D^−β when the runs give several token counts D
per size (the Chinchilla form). The fit is robust, as in the Chinchilla paper: L-BFGS-B on a Huber loss of the
log residuals (log L_pred − log L), the positive coefficients in log space, from a grid of starts.

What each number of `scaling_verdict` is:
- **gap(N)** = L_prism(N) − L_uniform(N) on the two fits (< 0: Prism better).
- **k(N)**, the compute multiplier: the training compute uniform needs to reach Prism's loss at N, over
  Prism's compute at N, both at the study's tokens per parameter (compute ∝ N·D ∝ N², so k = (N_u/N)² where
  L_u(N_u) = L_p(N)). k > 1: uniform needs k× the compute; inf: Prism's loss is below anything the uniform fit
  reaches; k < 1: uniform is better.
- **k_time(N)** = k · (Prism's tokens/s / uniform's tokens/s) at N: the multiplier in GPU-hours. It assumes
  tokens/s falls as 1/N at a fixed machine (constant MFU), so uniform's time at N_u is k· its time at N; a
  Prism that trains slower than uniform loses that share of k.
- Each has a bootstrap interval that resamples the seeds within each size and arm (a drawn seed brings all its
  points) and refits both arms: it measures **training noise** (which seeds were run), propagated through the
  fits. It does not measure whether the power law is the right form, nor evaluation noise (the validation set
  is the same for every run). With one seed per size there is no seed noise to measure: the intervals are nan;
  a size with one seed while others have several adds nothing to the interval (`min_seeds` says so). With
  3 seeds per size and arm the 95 % interval of k covers the true k in >= 90 of 100 synthetic studies
  (tests/integration/test_fits_coverage.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special

from pipeline.statistics import one_blas_thread

# Chinchilla's Huber threshold on log residuals: points more than 0.1 % off the curve count linearly, so one
# bad run bends the fit less than under least squares.
HUBER_DELTA = 1e-3
ALPHA_BOUNDS = (0.01, 3.0)  # exponents: a flat term (α → 0) would merge with E
ARMS = ("uniform", "prism")


@dataclass(frozen=True)
class PowerLaw:
    """L(N) = E + A·N^−α (+ B·D^−β when ``beta`` is not None): E the irreducible loss, A·N^−α what a larger
    model removes, B·D^−β what more tokens remove."""

    E: float
    A: float
    alpha: float
    B: float | None = None
    beta: float | None = None

    def loss(self, N, D=None) -> np.ndarray | float:
        """The predicted loss at N parameters (and D tokens, required by the 2-D form); arrays broadcast."""
        total = self.E + self.A * np.asarray(N, dtype=float) ** -self.alpha
        if self.beta is not None:
            if D is None:
                raise ValueError("the L(N, D) fit needs the token count D to predict a loss")
            total = total + self.B * np.asarray(D, dtype=float) ** -self.beta
        return float(total) if np.ndim(total) == 0 else total


# --- the robust fit ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Data:
    """log N and log D centred on their means (so A's and B's log-coefficients are not tied to the exponents
    by a factor log N ≈ 20), and log L."""

    x: np.ndarray
    y: np.ndarray | None
    log_loss: np.ndarray
    centre_n: float
    centre_d: float


def _prepare(N, L, D) -> _Data:
    log_n, log_loss = np.log(np.asarray(N, dtype=float)), np.log(np.asarray(L, dtype=float))
    if D is None:
        return _Data(log_n - log_n.mean(), None, log_loss, float(log_n.mean()), 0.0)
    log_d = np.log(np.asarray(D, dtype=float))
    return _Data(log_n - log_n.mean(), log_d - log_d.mean(), log_loss, float(log_n.mean()), float(log_d.mean()))


def _objective(flat: np.ndarray, data: _Data, weights: np.ndarray) -> tuple[float, np.ndarray]:
    """Weighted Huber loss of the log residuals and its gradient, for R fits stacked side by side.

    ``flat`` holds R parameter rows (e, a, α[, b, β]) with E = e^e, A·N^−α = e^(a − α·x); ``weights`` (R,
    points) says how often each point counts in each fit. The fits share no parameter, so one L-BFGS-B run
    solves them all at numpy speed."""
    two_d = data.y is not None
    theta = flat.reshape(weights.shape[0], 5 if two_d else 3)
    terms = [np.broadcast_to(theta[:, :1], weights.shape), theta[:, 1:2] - theta[:, 2:3] * data.x]
    if two_d:
        terms.append(theta[:, 3:4] - theta[:, 4:5] * data.y)
    stacked = np.stack(terms)  # (terms, R, points)
    log_pred = np.logaddexp.reduce(stacked, axis=0)
    share = np.exp(stacked - log_pred)  # d log_pred / d term
    residual = log_pred - data.log_loss
    value = float(np.sum(weights * special.huber(HUBER_DELTA, residual))) / HUBER_DELTA**2
    slope = weights * np.clip(residual, -HUBER_DELTA, HUBER_DELTA) / HUBER_DELTA**2
    grads = [np.sum(slope * share[0], 1), np.sum(slope * share[1], 1), -np.sum(slope * share[1] * data.x, 1)]
    if two_d:
        grads += [np.sum(slope * share[2], 1), -np.sum(slope * share[2] * data.y, 1)]
    return value, np.stack(grads, axis=1).ravel()


def _minimize(data: _Data, weights: np.ndarray, theta0: np.ndarray) -> np.ndarray:
    """The (R, params) rows minimizing each fit's Huber loss, from ``theta0``."""
    top = float(data.log_loss.max())
    bound = [(top - 12.0, top), (-30.0, 30.0), ALPHA_BOUNDS] + (
        [(-30.0, 30.0), ALPHA_BOUNDS] if theta0.shape[1] == 5 else []
    )
    with one_blas_thread():  # L-BFGS-B's BLAS calls are tiny: threads only cost here
        result = optimize.minimize(
            _objective,
            theta0.ravel(),
            args=(data, weights),
            jac=True,
            method="L-BFGS-B",
            bounds=bound * theta0.shape[0],
            options={"maxiter": 3000, "ftol": 1e-12, "gtol": 1e-8},
        )
    return result.x.reshape(theta0.shape)


def _starts(data: _Data, per_axis: int) -> np.ndarray:
    """The grid of starts: E at fractions of the lowest loss, each exponent over a spread of values, and each
    coefficient set so the curve starts through the median loss at the centre size (and token count)."""
    lowest, middle = float(np.exp(data.log_loss.min())), float(np.exp(np.median(data.log_loss)))
    fractions = np.linspace(0.05, 0.9, per_axis)
    exponents = np.geomspace(0.1, 1.0, per_axis)
    rows = []
    for fraction in fractions:
        e = np.log(fraction * lowest)
        excess = max(middle - fraction * lowest, 1e-6 * middle)
        if data.y is None:
            rows += [(e, np.log(excess), alpha) for alpha in exponents]
        else:
            half = np.log(excess / 2)
            rows += [(e, half, alpha, half, beta) for alpha in exponents for beta in exponents]
    return np.array(rows)


def _to_power_law(theta: np.ndarray, data: _Data) -> PowerLaw:
    """A parameter row (e, a, α[, b, β]) of the centred log space as the law in N and D."""
    E, A, alpha = float(np.exp(theta[0])), float(np.exp(theta[1] + theta[2] * data.centre_n)), float(theta[2])
    if data.y is None:
        return PowerLaw(E, A, alpha)
    return PowerLaw(E, A, alpha, float(np.exp(theta[3] + theta[4] * data.centre_d)), float(theta[4]))


def _to_theta(law: PowerLaw, data: _Data) -> np.ndarray:
    """The inverse of _to_power_law."""
    theta = [np.log(law.E), np.log(law.A) - law.alpha * data.centre_n, law.alpha]
    if data.y is not None:
        theta += [np.log(law.B) - law.beta * data.centre_d, law.beta]
    return np.array(theta)


def _check_points(N, L, D) -> None:
    """ValueError naming what the fit lacks (or what is not a positive number)."""
    arrays = [np.asarray(v, dtype=float) for v in ((N, L) if D is None else (N, L, D))]
    if len({a.shape for a in arrays}) != 1 or arrays[0].ndim != 1:
        raise ValueError(f"N, L (and D) must be 1-D arrays of one length (got shapes {[a.shape for a in arrays]})")
    if not all(np.all(np.isfinite(a) & (a > 0)) for a in arrays):
        raise ValueError("N, L (and D) must be finite and positive")
    sizes = len(np.unique(arrays[0]))
    if D is None and sizes < 3:
        raise ValueError(f"the L(N) fit needs at least 3 distinct model sizes N; got {sizes}")
    if D is not None:
        tokens = len(np.unique(arrays[2]))
        if len(arrays[0]) < 5 or sizes < 2 or tokens < 2:
            raise ValueError(
                "the L(N, D) fit needs at least 5 points with at least 2 distinct N and 2 distinct D; "
                f"got {len(arrays[0])} points, {sizes} distinct N, {tokens} distinct D"
            )


def fit_power_law(
    N: Sequence[float], L: Sequence[float], D: Sequence[float] | None = None, starts: int = 3
) -> PowerLaw:
    """The robust fit of L(N) = E + A·N^−α (``D`` None) or L(N, D) = E + A·N^−α + B·D^−β to the points.

    ``starts`` is the number of values per axis of the grid of starts (E, α and β): 3 gives 9 starts for L(N),
    27 for L(N, D); the lowest Huber loss wins. Several points may share an N (seeds): each counts once.
    Raises ValueError naming the count when the points are too few for the form: L(N) needs 3 distinct N,
    L(N, D) 5 points with 2 distinct N and 2 distinct D."""
    _check_points(N, L, D)
    data = _prepare(N, L, D)
    ones = np.ones((1, len(data.x)))
    fitted = [_minimize(data, ones, start[None, :])[0] for start in _starts(data, starts)]
    best = min(fitted, key=lambda theta: _objective(theta, data, ones)[0])
    return _to_power_law(best, data)


# --- the compute multiplier ----------------------------------------------------------------------------
def _size_reaching(law: PowerLaw, target: float, tokens_per_param: float) -> float:
    """The N at which the L(N, D = tokens_per_param·N) fit reaches ``target`` (> E), by Brent's method on
    log N: each term falls monotonically, so the root lies between where one term alone equals the excess and
    where each is at most half of it."""
    log_excess = np.log(target - law.E)
    coefs = np.log([law.A, law.B * tokens_per_param**-law.beta])
    exps = np.array([law.alpha, law.beta])
    low = float(np.min((coefs - log_excess) / exps))
    high = float(np.max((coefs - log_excess + np.log(2.0)) / exps))
    log_n = optimize.brentq(lambda u: np.logaddexp(*(coefs - exps * u)) - log_excess, low, high, xtol=1e-12)
    return float(np.exp(log_n))


def compute_multiplier(uniform: PowerLaw, prism: PowerLaw, N, tokens_per_param: float | None = None) -> np.ndarray:
    """k(N): the training compute uniform needs to reach Prism's loss at N, divided by Prism's compute at N.

    At a fixed number of tokens per parameter compute ∝ N·D ∝ N², so k = (N_u/N)² with L_u(N_u) = L_p(N).
    For the L(N) fits that is closed form; for L(N, D) fits both arms are read at D = tokens_per_param·N
    (required then). inf where Prism's loss is at or below uniform's E (no uniform size reaches it); below 1
    where uniform is better."""
    if (uniform.beta is None) != (prism.beta is None):
        raise ValueError("both arms' fits must have one form (both L(N) or both L(N, D))")
    sizes = np.atleast_1d(np.asarray(N, dtype=float))
    if uniform.beta is None:
        excess = prism.loss(sizes) - uniform.E
        with np.errstate(divide="ignore"):
            reached = np.where(excess > 0, (uniform.A / np.maximum(excess, 0.0)) ** (1.0 / uniform.alpha), np.inf)
    else:
        if tokens_per_param is None or not tokens_per_param > 0:
            raise ValueError(
                "the L(N, D) fits need tokens_per_param (> 0) to compare the arms at D = tokens_per_param·N"
            )
        target = np.atleast_1d(prism.loss(sizes, tokens_per_param * sizes))
        reached = np.array([_size_reaching(uniform, t, tokens_per_param) if t > uniform.E else np.inf for t in target])
    return (reached / sizes) ** 2


# --- the verdict across sizes --------------------------------------------------------------------------
@dataclass(frozen=True)
class _Arm:
    """One arm's points as arrays, and which seed of its size each point belongs to."""

    N: np.ndarray
    D: np.ndarray
    loss: np.ndarray
    tokens_per_sec: np.ndarray
    groups: list[np.ndarray]  # per size: each point's seed index within that size
    members: list[np.ndarray]  # per size: the indices of its points

    @classmethod
    def of(cls, points: list[dict]) -> _Arm:
        N = np.array([float(p["N"]) for p in points])
        groups, members = [], []
        for size in np.unique(N):
            idx = np.flatnonzero(N == size)
            seeds = [str(points[i]["seed"]) for i in idx]
            groups.append(np.unique(seeds, return_inverse=True)[1])
            members.append(idx)
        return cls(
            N,
            np.array([float(p["D"]) for p in points]),
            np.array([float(p["loss"]) for p in points]),
            np.array([np.nan if p.get("tokens_per_sec") is None else float(p["tokens_per_sec"]) for p in points]),
            groups,
            members,
        )

    def several_tokens_per_size(self) -> bool:
        return any(len(np.unique(self.D[idx])) > 1 for idx in self.members)

    def fewest_seeds(self) -> int:
        return min(int(g.max()) + 1 for g in self.groups)

    def most_seeds(self) -> int:
        return max(int(g.max()) + 1 for g in self.groups)

    def seed_weights(self, boot: int, rng: np.random.Generator) -> np.ndarray:
        """(boot, points): how often each point counts in each replicate. Per size, its n seeds are drawn n
        times with replacement; a drawn seed brings all its points (every token count it was measured at)."""
        weights = np.zeros((boot, len(self.N)))
        for seed_of, idx in zip(self.groups, self.members):
            n = int(seed_of.max()) + 1
            counts = np.stack([np.bincount(row, minlength=n) for row in rng.integers(0, n, size=(boot, n))])
            weights[:, idx] = counts[:, seed_of]
        return weights

    def resampling_loss(self) -> np.ndarray:
        """The losses the bootstrap resamples: in each (N, D) cell of n >= 2 seeds, each log loss's distance from
        the cell's mean stretched by sqrt(n / (n − 1)). Drawing n of n seeds shrinks the spread by (n − 1)/n
        in variance (2/3 at 3 seeds, which left the 95 % interval of k covering the truth ~80 % of the time);
        the stretch undoes it (Davison & Hinkley's modified residuals)."""
        log_loss = np.log(self.loss)
        out = log_loss.copy()
        for idx in self.members:
            for tokens in np.unique(self.D[idx]):
                cell = idx[self.D[idx] == tokens]
                if len(cell) > 1:
                    mean = log_loss[cell].mean()
                    out[cell] = mean + np.sqrt(len(cell) / (len(cell) - 1)) * (log_loss[cell] - mean)
        return np.exp(out)

    def speed(self, sizes: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Weighted mean tokens/s at each of ``sizes`` (nan where none was measured)."""
        known = np.isfinite(self.tokens_per_sec)
        out = np.full(len(sizes), np.nan)
        for i, size in enumerate(sizes):
            w = weights * known * (self.N == size)
            if w.sum() > 0:
                out[i] = np.sum(w * np.where(known, self.tokens_per_sec, 0.0)) / w.sum()
        return out


def _speed_ratio(uniform: _Arm, prism: _Arm, grid: np.ndarray, w_uniform: np.ndarray, w_prism: np.ndarray):
    """Prism's tokens/s over uniform's on the grid: measured at the sizes both arms ran, interpolated in log N
    between them (held flat beyond); nan when no size has both."""
    sizes = np.intersect1d(uniform.N, prism.N)
    ratio = prism.speed(sizes, w_prism) / uniform.speed(sizes, w_uniform)
    ok = np.isfinite(ratio)
    if not ok.any():
        return np.full(len(grid), np.nan)
    return np.interp(np.log(grid), np.log(sizes[ok]), ratio[ok])


def _measures(laws: dict[str, PowerLaw], arms: dict[str, _Arm], grid, tpp: float | None, weights) -> np.ndarray:
    """(3, grid): gap, k and k_time of one pair of fits; ``weights`` {arm: (points,)} weigh the tokens/s
    (ones for the point estimate, the seed draw in a replicate). ``tpp`` None: the L(N) form."""
    tokens = None if tpp is None else tpp * grid
    gap = laws["prism"].loss(grid, tokens) - laws["uniform"].loss(grid, tokens)
    k = compute_multiplier(laws["uniform"], laws["prism"], grid, tpp)
    ratio = _speed_ratio(arms["uniform"], arms["prism"], grid, weights["uniform"], weights["prism"])
    return np.stack([np.atleast_1d(gap), k, k * ratio])


def _refits(arm: _Arm, law: PowerLaw, two_d: bool, weights: np.ndarray) -> list[PowerLaw]:
    """The fit of each bootstrap replicate (a row of ``weights``), all warm-started from the point fit and
    solved as one stacked L-BFGS-B run."""
    data = _prepare(arm.N, arm.resampling_loss(), arm.D if two_d else None)
    fitted = _minimize(data, weights, np.tile(_to_theta(law, data), (len(weights), 1)))
    return [_to_power_law(row, data) for row in fitted]


def _bootstrap_bounds(arms: dict[str, _Arm], laws, grid, tpp: float | None, boot: int, seed: int, level: float):
    """(2, 3, grid): the low and high percentiles of gap, k and k_time over ``boot`` seed-resampled refits."""
    rng = np.random.default_rng(seed)
    weights = {arm: a.seed_weights(boot, rng) for arm, a in arms.items()}
    refits = {arm: _refits(arms[arm], laws[arm], tpp is not None, weights[arm]) for arm in ARMS}
    replicates = np.stack(
        [
            _measures({arm: refits[arm][r] for arm in ARMS}, arms, grid, tpp, {arm: weights[arm][r] for arm in ARMS})
            for r in range(boot)
        ]
    )  # (boot, 3, grid)
    tail = (1.0 - level) / 2.0
    # no interpolation between replicates: k may be inf in some, and inf − inf is nan
    low = np.quantile(replicates, tail, axis=0, method="lower")
    return np.stack([low, np.quantile(replicates, 1.0 - tail, axis=0, method="higher")])


def scaling_verdict(
    points: list[dict], N_grid=None, boot: int = 200, seed: int = 0, level: float = 0.95, starts: int = 3
) -> dict:
    """Both arms' fits across sizes, and the gap, k and k_time on a grid of sizes with bootstrap intervals.

    ``points``: one dict per measured final loss, {"arm": "uniform" | "prism", "N": parameters, "D": tokens,
    "loss": final val loss, "seed": str, "tokens_per_sec": float (nan or absent when unknown)}. Each arm is fitted
    by L(N) when it has one D per size, else by L(N, D), both arms then read at D = tokens_per_param·N, the
    study's tokens per parameter (the median D/N over all points). ``N_grid``: the sizes to report (default:
    every measured N). ``starts``: the point fits' grid of starts per axis (see fit_power_law).

    Returns {"fits": {arm: PowerLaw}, "form": "L(N)" | "L(N,D)", "tokens_per_param": float, "min_seeds": the
    fewest seeds any size of either arm has, "rows": one dict per grid size: "N", "loss_uniform",
    "loss_prism" (the fits there), "gap", "k", "k_time" (see the module docstring) and "<name>_low",
    "<name>_high" for gap, k and k_time: the central ``level`` percentile interval of ``boot`` replicates that
    resample seeds within each size and arm and refit both arms (training noise). The intervals are nan when
    no size has two seeds (no seed noise to resample) or ``boot`` is 0; k_time is nan without tokens/s.
    Raises ValueError when an arm is missing or has too few sizes or points for its form."""
    by_arm = {arm: [p for p in points if p["arm"] == arm] for arm in ARMS}
    missing = [arm for arm in ARMS if not by_arm[arm]]
    if missing:
        raise ValueError(f"the scaling verdict needs runs of both arms; no {' or '.join(missing)} run was given")
    arms = {arm: _Arm.of(by_arm[arm]) for arm in ARMS}
    two_d = any(a.several_tokens_per_size() for a in arms.values())
    tokens_per_param = float(np.median([float(p["D"]) / float(p["N"]) for p in points]))
    tpp = tokens_per_param if two_d else None
    laws = {}
    for arm, a in arms.items():
        try:
            laws[arm] = fit_power_law(a.N, a.loss, a.D if two_d else None, starts)
        except ValueError as e:
            raise ValueError(f"{arm} arm: {e}") from None
    grid = np.unique(np.concatenate([a.N for a in arms.values()])) if N_grid is None else np.asarray(N_grid, float)
    point = _measures(laws, arms, grid, tpp, {arm: np.ones(len(a.N)) for arm, a in arms.items()})
    min_seeds = min(a.fewest_seeds() for a in arms.values())
    bounds = np.full((2, 3, len(grid)), np.nan)
    if boot > 0 and max(a.most_seeds() for a in arms.values()) > 1:
        bounds = _bootstrap_bounds(arms, laws, grid, tpp, boot, seed, level)
    rows = []
    for i, size in enumerate(grid):
        row = {"N": float(size)}
        tokens = None if tpp is None else tpp * size
        row["loss_uniform"], row["loss_prism"] = (float(laws[arm].loss(size, tokens)) for arm in ARMS)
        for j, name in enumerate(("gap", "k", "k_time")):
            row[name], row[f"{name}_low"], row[f"{name}_high"] = (float(m[j, i]) for m in (point, *bounds))
        rows.append(row)
    form = "L(N,D)" if two_d else "L(N)"
    return {"fits": laws, "form": form, "tokens_per_param": tokens_per_param, "min_seeds": min_seeds, "rows": rows}

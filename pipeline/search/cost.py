"""`prism search SPEC --dry-run`: what a search will cost, in trials, tokens (against the full grid's) and,
with `prism plan`'s numbers, GPU hours at a stated MFU."""

from __future__ import annotations

from pathlib import Path

from pipeline import config
from pipeline.console import duration
from pipeline.search.spec import SearchSpec, trial_overrides


def expected_tokens(spec: SearchSpec) -> int:
    """Tokens if every rung keeps exactly 1/eta of the trials reaching it (ASHA's asymptotic count)."""
    points, eta, n = spec.rungs.points, spec.rungs.reduction_factor, spec.trials
    total, reached = 0.0, float(n)
    for k, tokens in enumerate(points):
        promoted = reached / eta if k < len(points) - 1 else 0.0
        total += (reached - promoted) * tokens
        reached = promoted
    return int(round(total))


def dry_run(spec: SearchSpec, mfu: float = 0.4, peak_flops: float | None = None) -> str:
    from pipeline.budget import make_budget

    r, base = spec.rungs, spec.base
    cfg = config.load(spec.config_path, trial_overrides(spec, 0, spec.schedules[0], None))
    nodes = int(spec.slurm.get("nodes", 1))
    gpus = int(spec.slurm.get("gpus_per_node", 1)) or 1
    budget = make_budget(cfg, nodes, gpus, mfu, peak_flops)
    search = expected_tokens(spec)
    grid = len(spec.schedules) * r.full_tokens
    confirm_runs = (spec.confirm_top_k + 1) * spec.confirm_seeds
    steps = [t // base.train.batch_tokens for t in r.points]
    lines = [
        f"prism search {spec.name}: {spec.path}",
        f"  base         {_shown(spec.config_path)} ({base.run.scale}, {base.model.num_layers} layers, d_model "
        f"{base.model.d_model}) + {len(spec.overrides)} overrides",
        f"  space        {len(spec.schedules)} schedules ({spec.schedules_from})"
        + (f", lr log-uniform in [{spec.lr[0]:g}, {spec.lr[1]:g}]" if spec.lr else ""),
        f"  trials       {spec.trials}, {spec.concurrency} at a time on {spec.executor}; sampler {spec.sampler}, "
        f"pruner {'SuccessiveHalving (ASHA)' if spec.pruner == 'asha' else 'Hyperband'}, seed {spec.seed}",
        f"  rungs        {' -> '.join(f'{t:,}' for t in r.points)} tokens ({' / '.join(map(str, steps))} steps), "
        f"reduction factor {r.reduction_factor}; every trial uses the {r.full_tokens:,}-token LR schedule",
        f"  tokens       ~{search:,} expected (1/{r.reduction_factor} promoted per rung) against the full grid's "
        f"{len(spec.schedules)} x {r.full_tokens:,} = {grid:,} ({search / grid:.0%})",
    ]
    if confirm_runs:
        lines.append(
            f"  confirm      top {spec.confirm_top_k} + uniform x {spec.confirm_seeds} seeds = {confirm_runs} runs x "
            f"{r.full_tokens:,} = {confirm_runs * r.full_tokens:,} tokens"
        )
    if budget.wall_seconds is None:
        lines.append(
            f"  GPU hours    unknown: pass --peak-tflops (FLOPs/token {budget.flops_per_token:,} from prism plan)"
        )
    else:
        per_token = budget.wall_seconds * budget.world / budget.tokens / 3600  # GPU hours per token at this MFU
        lines.append(
            f"  GPU hours    search ~{search * per_token:,.1f}, full grid {grid * per_token:,.1f}"
            + (f", confirmation {confirm_runs * r.full_tokens * per_token:,.1f}" if confirm_runs else "")
            + f" at MFU {mfu:.0%} of {budget.peak_flops / 1e12:,.0f} TFLOP/s ({budget.flops_per_token:,} FLOPs/token, "
            f"prism plan); one trial: {duration(budget.wall_seconds)} on {budget.world} GPU(s)"
        )
    return "\n".join(lines)


def _shown(path: Path) -> str:
    """A path as the user would type it: relative to the cwd when it lies below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)

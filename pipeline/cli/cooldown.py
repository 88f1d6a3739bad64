"""`prism cooldown RUN_DIR --from-step N [N2 ...] (--decay-tokens T | --decay-fraction F) [--launch local|print]`:
cooldown branches of a main run, each an annealed point (pipeline.cooldown)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.config import Config

LAUNCHES = ("local", "print")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cooldown",
        help="branch a main run at a checkpoint and decay its LR: an annealed point at that many tokens",
        description="Start a new run (its own folder <output_dir>/<run>-cooldown-<N>, MLflow run, latest, resume "
        "and exit codes) from the main run's checkpoint at step N: its weights, optimizer state and exact data "
        "order. It trains --decay-tokens more tokens while the LR decays from the main run's LR at step N to "
        "train.min_lr. Everything is checked before either folder is touched (exit 2 with one line).",
    )
    p.add_argument("run_dir", help="the main run's folder, e.g. runs/prism-tiny-s1234")
    p.add_argument(
        "--from-step",
        required=True,
        nargs="+",
        help="checkpoint step(s) to branch at: N, N1 N2 ... or N1,N2,... (one branch each)",
    )
    decay = p.add_mutually_exclusive_group(required=True)
    decay.add_argument("--decay-tokens", type=int, help="tokens each branch trains while its LR decays")
    decay.add_argument(
        "--decay-fraction",
        type=float,
        help="the share of each branch's length (its main steps plus the decay) that decays, like "
        "train.decay_fraction: 0.1 at step 900 decays over 100 steps",
    )
    p.add_argument("--decay-shape", choices=["linear", "1-sqrt", "cosine"], help="default: train.decay_shape")
    p.add_argument("--out", help="run.output_dir of the branches (default: the main run's; MLflow: the main run's)")
    p.add_argument(
        "--launch",
        choices=LAUNCHES,
        default="local",
        help="local: train each branch here, one after another; print: write the configs and print the "
        "prism train / torchrun / sbatch commands",
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides for the branches, e.g. train.device=cpu")
    p.epilog = "example: prism cooldown runs/prism-tiny-s1234 --from-step 96 192 --decay-fraction 0.1"
    p.set_defaults(func=run)


def steps_of(given: list[str]) -> tuple[list[int], list[str]]:
    """--from-step's steps (spaced or comma-separated), and the dotted overrides argparse swept in after them."""
    from pipeline.config import ConfigError

    words = [w for arg in given if "=" not in arg for w in arg.split(",") if w]
    try:
        steps = [int(w) for w in words]
    except ValueError:
        raise ConfigError(f"--from-step {' '.join(given)!r}: give steps, e.g. --from-step 96 192") from None
    if not steps:
        raise ConfigError("--from-step: give at least one step, e.g. --from-step 96 192")
    if len(set(steps)) != len(steps):
        raise ConfigError(f"--from-step {' '.join(given)}: repeats a step; each branch needs its own")
    return steps, [arg for arg in given if "=" in arg]


def run(args: argparse.Namespace) -> int:
    from pipeline import cooldown

    steps, swept_in = steps_of(args.from_step)
    overrides = [*swept_in, *args.overrides]
    branches = [
        cooldown.branch_config(
            args.run_dir, step, args.decay_tokens, args.decay_fraction, args.decay_shape, args.out, overrides
        )
        for step in steps
    ]
    for cfg in branches:  # every branch checked before any is written or trained
        cooldown.start_point(cfg, dp=None)
    paths = [cooldown.write_config(cfg) for cfg in branches]
    if args.launch == "print":
        for cfg, path in zip(branches, paths):
            print(f"# {cfg.run_name}: {cfg.cooldown.decay_tokens:,} tokens from step {cfg.cooldown.from_step}")
            print(f"prism train {shlex.quote(str(path))}")
            print(f"torchrun --nproc-per-node N -m pipeline.cli train {shlex.quote(str(path))}")
            print(f"PRISM_CONFIG={shlex.quote(str(path))} sbatch {launcher(cfg)}")
        return 0
    return train_each(branches, paths)


def launcher(cfg: Config) -> str:
    """The arm's and scale's Slurm launcher; any launchers/*.sbatch runs the config PRISM_CONFIG names."""
    own = Path("launchers") / f"{cfg.run.arm}_{cfg.run.scale}.sbatch"
    return str(own) if own.is_file() else f"launchers/prism_124m.sbatch  # no {own}: any launcher, its #SBATCH lines"


def train_each(branches: list[Config], paths: list[Path]) -> int:
    """`prism train` on each branch's config in turn (a process each: a run owns its process group); the first
    exit code that is not 0 ends the verb with it."""
    import subprocess

    for cfg, path in zip(branches, paths):
        print(f"prism cooldown: {cfg.run_name} -> {cfg.run_dir}", flush=True)
        code = subprocess.call([sys.executable, "-m", "pipeline.cli", "train", str(path)])
        if code:
            print(f"prism cooldown: {cfg.run_name} exited with {code}", file=sys.stderr, flush=True)
            return code
    return 0

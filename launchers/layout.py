"""Check a job's layout against its config before any worker starts (train_job.sh calls it on the batch node).

    python -m launchers.layout NODES PROCS_PER_NODE CONFIG [overrides...]

Prints one line, `layout: 2 node(s) x 2 proc(s) = world 4 = TP 2 x DP 2, ...`, and exits 0; or prints one
line naming what the config cannot use and the fix, and exits 2 (so a bad layout fails in seconds, not after
the model has been built on every node).
"""

from __future__ import annotations

import sys

from pipeline import config
from pipeline.config import ConfigError
from pipeline.exit_codes import EXIT_BAD_INPUT


def describe(nodes: int, procs_per_node: int, cfg: config.Config) -> str:
    """The layout line; raises ConfigError when the world cannot run ``cfg``."""
    world = nodes * procs_per_node
    tp = cfg.parallel.tp
    if world % tp:
        raise ConfigError(
            f"{nodes} node(s) x {procs_per_node} proc(s) = world {world} is not divisible by parallel.tp={tp}; "
            f"use a number of processes per node (PRISM_NPROC_PER_NODE) or nodes whose product is a multiple of {tp}"
        )
    if procs_per_node % tp and tp % procs_per_node:
        # Megatron's TP groups are consecutive ranks: a group would straddle nodes unevenly.
        raise ConfigError(
            f"parallel.tp={tp} and {procs_per_node} proc(s) per node: tensor-parallel groups would straddle nodes; "
            f"use a multiple or a divisor of {tp} processes per node"
        )
    dp = world // tp
    steps = cfg.steps(dp)  # refuses a batch that does not split over DP
    return (
        f"layout: {nodes} node(s) x {procs_per_node} proc(s) = world {world} = TP {tp} x DP {dp}, "
        f"{steps['total']} steps, grad_accum {steps['grad_accum']}"
    )


def main(argv: list[str]) -> int:
    if len(argv) < 3 or not (argv[0].isdigit() and argv[1].isdigit()) or min(int(argv[0]), int(argv[1])) < 1:
        print("layout: usage: python -m launchers.layout NODES PROCS_PER_NODE CONFIG [overrides...]", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        cfg = config.load(argv[2], argv[3:])
        print(describe(int(argv[0]), int(argv[1]), cfg), flush=True)
    except ConfigError as e:
        print(f"layout: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`prism train CONFIG [overrides]`: one process, or one of many under torchrun / srun.

Its exit codes (launchers act on them) are pipeline.exit_codes'.
"""

from __future__ import annotations

import argparse
import os

from pipeline.exit_codes import TRAIN_EXIT_CODES


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train (or resume) one run with DeepSpeed + Megatron-core",
        description="Train one run; resumes automatically from <checkpoint_dir>/latest. LR schedule: "
        "train.lr_schedule=cosine (warmup, cosine to train.min_lr) or wsd (warmup, constant, then the last "
        "train.decay_fraction of the steps decay, shaped train.decay_shape=linear|1-sqrt|cosine); `prism plan "
        "CONFIG --lr-curve` draws it. A config with cooldown.from_step and cooldown.decay_tokens is a cooldown "
        "branch of its main run (prism cooldown writes one). "
        f"Exit codes: {TRAIN_EXIT_CODES}.",
    )
    p.add_argument("config", help="YAML preset, e.g. configs/tiny_prism.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4 parallel.tp=2")
    p.epilog = "example: prism train configs/tiny_prism.yaml run.seed=2 train.train_tokens=81920"
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline import config
    from pipeline.config import ConfigError
    from pipeline.distributed import setup_threads
    from pipeline.exit_codes import EXIT_BAD_INPUT, RECORD_REASONS, write_exit_record
    from pipeline.schedule import ScheduleError
    from pipeline.train import train

    try:
        cfg = config.load(args.config, args.overrides)
        print(f"prism train: {cfg.run_name}: loading torch/megatron/deepspeed and building the model ...", flush=True)
        setup_threads()
        summary = train(cfg)
    except (ConfigError, ScheduleError):  # exit 2: never retried (pipeline/restart.py)
        if os.environ.get("RANK", "0") == "0":
            write_exit_record(RECORD_REASONS[EXIT_BAD_INPUT], 0)
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return summary["exit_code"]

"""`prism prepare CONFIG [overrides]` builds a dataset; `prism prepare --verify DIR` re-hashes one."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "prepare",
        help="tokenise a corpus into webdataset shards + manifest.json (datatrove)",
        description="Build (or resume) data.dataset_dir from data.input with datatrove; or verify a dataset.",
    )
    p.add_argument("config", nargs="?", help="YAML preset, e.g. configs/tiny_prism.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.tasks=4")
    p.add_argument("--overwrite", action="store_true", help="delete a dataset of another config and rebuild")
    p.add_argument("--verify", metavar="DIR", help="re-hash DIR's shards against its manifest and report")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.config import ConfigError

    if args.verify:
        if args.config:
            raise ConfigError("--verify DIR takes no CONFIG; run it alone: prism prepare --verify DIR")
        from data_prep.manifest import verify
        from pipeline.dataset import DataError

        problems = verify(args.verify)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        if problems:
            raise DataError(
                f"{args.verify}: manifest does not match its shards ({len(problems)} problems, listed above); "
                "rebuild with prism prepare CONFIG --overwrite"
            )
        print(f"prism prepare: {args.verify} verified: every shard matches manifest.json")
        return 0
    if not args.config:
        raise ConfigError("give a CONFIG to build (prism prepare configs/tiny_prism.yaml) or --verify DIR")
    from data_prep.build import prepare
    from pipeline import config

    prepare(config.load(args.config, args.overrides), overwrite=args.overwrite)
    return 0

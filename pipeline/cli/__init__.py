"""`prism` — one CLI, one module per verb. Each verb module is thin: parse, call a library function, print.

A verb module exposes ``add_parser(subparsers)`` (which sets ``func``) and ``run(args)``, and imports torch,
megatron, deepspeed, mlflow and datatrove only inside ``run``, so `prism --help` stays fast. Every verb is
imported here by name: a broken verb fails loudly instead of disappearing from the help.
"""

from __future__ import annotations

import argparse
import sys

from pipeline.cli import (
    attention_distance,
    compare,
    cooldown,
    demo,
    eval,
    export,
    generate,
    model,
    plan,
    prepare,
    profile,
    scaling,
    schedule,
    search,
    study,
    sweep,
    tracking,
    train,
)
from pipeline.config import ConfigError
from pipeline.exit_codes import EXIT_BAD_INPUT
from pipeline.schedule import ScheduleError

# The order `prism --help` lists them in: the study's stages, then the tools.
VERB_MODULES = (
    schedule,
    model,
    plan,
    prepare,
    train,
    profile,
    cooldown,
    tracking,
    compare,
    scaling,
    eval,
    export,
    generate,
    attention_distance,
    sweep,
    search,
    study,
    demo,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prism",
        description="Prism Transformer pretraining study pipeline",
        epilog="example: prism demo   (the whole study in miniature, offline on CPU); prism VERB --help for each verb",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show library output (warnings, MLflow INFO, datatrove logs) on the terminal; by default it goes "
        "to <run.output_dir>/logs/prism-VERB.log. Accepted anywhere on the command line (default: off)",
    )
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for module in VERB_MODULES:
        module.add_parser(sub)
    for name, p in _all_parsers(sub):
        p.formatter_class = HelpWithDefaults
        if not p.epilog and name in EXAMPLES:
            p.epilog = f"example: {EXAMPLES[name]}"
    return parser


# The example each verb's --help ends with (a verb module may set its own epilog instead).
EXAMPLES = {
    "schedule validate": "prism schedule validate --d-model 768 --layers 12 --h-base 12 --heads 3x2,6x2,8x2,12x6",
    "schedule show": "prism schedule show configs/prism_124m.yaml",
    "schedule enumerate": "prism schedule enumerate --d-model 192 --layers 8 --h-base 12 --limit 10",
    "model report": "prism model report configs/prism_354m.yaml parallel.tp=2",
    "plan": "prism plan configs/prism_757m.yaml --nodes 1 --gpus-per-node 8 --peak-tflops 989",
    "prepare": "prism prepare configs/tiny_prism.yaml --overwrite data.tasks=2",
    "train": "prism train configs/tiny_prism.yaml run.seed=2 train.train_tokens=81920",
    "profile": "prism profile runs/prism-tiny-s1234 --steps 2",
    "tracking sync": "prism tracking sync runs/prism-tiny-s1234 --tracking-uri http://127.0.0.1:5000",
    "tracking grant": "prism tracking grant alice --experiment prism-tiny --tracking-uri http://127.0.0.1:5000 "
    "--password-file -",
    "compare": "prism compare --experiment prism-tiny --tracking-uri sqlite:///runs/mlflow.db",
    "scaling": "prism scaling --experiment prism-ladder-w64 prism-ladder-w128 prism-ladder-w192 "
    "--tracking-uri sqlite:///runs/ladder/mlflow.db",
    "eval": "prism eval runs/prism-tiny-s1234/checkpoints --tasks piqa,arc_easy --limit 50",
    "export": "prism export runs/prism-tiny-s1234 --out runs/prism-tiny-hf",
    "generate": "prism generate runs/prism-tiny-hf --prompt 'The history of' --max-new-tokens 32",
    "attention-distance": "prism attention-distance runs/prism-tiny-s1234/checkpoints "
    "--compare runs/uniform-tiny-s1234/checkpoints --sequences 16",
    "sweep": "prism sweep launchers/sweeps/example.yaml --dry-run",
    "study": "prism study configs/tiny_uniform.yaml configs/tiny_prism.yaml --seeds 3 run.output_dir=runs/study",
    "demo": "prism demo run.output_dir=/tmp/prism-demo",
}


class HelpWithDefaults(argparse.HelpFormatter):
    """Every flag's help ends with its default (unless it states one)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "default" in text:
            return text
        if action.default is None or action.default is False:
            return f"{text} (default: {'off' if action.default is False else 'none'})"
        return f"{text} (default: %(default)s)"


def _all_parsers(sub: argparse._SubParsersAction, prefix: str = ""):
    """(name, parser) of every verb and nested action, e.g. ('schedule show', parser)."""
    for name, p in sub.choices.items():
        yield prefix + name, p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                yield from _all_parsers(action, f"{prefix}{name} ")


# Where a verb collects its dotted KEY=VALUE overrides (the first of these its namespace has).
OVERRIDE_DESTS = ("overrides", "items", "checkpoints")


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """argparse, plus dotted overrides anywhere after the verb: `prism prepare CONFIG --overwrite data.tasks=2`.

    argparse stops filling a positional list at the first flag; the KEY=VALUE items it leaves over join the
    verb's overrides. Anything else left over is an error printed with the verb's own usage."""
    args, extra = parser.parse_known_args(argv)
    verb_parser = parser._subparsers._group_actions[0].choices[args.verb]  # type: ignore[union-attr]
    dest = next((d for d in OVERRIDE_DESTS if isinstance(getattr(args, d, None), list)), None)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or dest is None]
    if stray:
        verb_parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        setattr(args, dest, [*getattr(args, dest), *extra])
    return args


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("prism-pretrain")
    except PackageNotFoundError:  # run from a checkout without `pip install -e .`
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    from pipeline import console

    argv = list(sys.argv[1:] if argv is None else argv)
    want_verbose = "--verbose" in argv
    argv = [a for a in argv if a != "--verbose"]
    args = parse_args(build_parser(), argv)
    args.verbose = want_verbose
    with console.routed(args.verb, argv, want_verbose):
        try:
            return int(args.func(args) or 0)
        except (ConfigError, ScheduleError) as e:  # bad input: one line, no traceback
            print(f"prism {args.verb}: error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT

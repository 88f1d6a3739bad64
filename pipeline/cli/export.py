"""`prism export CHECKPOINT [--out DIR] [--dtype bf16|fp32] [--force]`: a Hugging Face model folder."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model folder (safetensors, tokenizer)")
    p.add_argument("checkpoint", help="tag folder (.../checkpoints/step-0000096) or a checkpoint/run folder")
    p.add_argument("overrides", nargs="*", help="dotted overrides for paths only, e.g. data.tokenizer=PATH")
    p.add_argument("--out", help="output folder (default <run_dir>/hf/<tag>)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="weight dtype (default: the run's train.precision)")
    p.add_argument("--force", action="store_true", help="replace an --out folder that exists and is not empty")
    p.add_argument("--step", type=int, help="the run's checkpoint at this step (a milestone, say), not `latest`")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.checkpoint import resolve_tag_dir
    from pipeline.export.hf import export

    path = args.checkpoint if args.step is None else resolve_tag_dir(args.checkpoint, args.step)
    report = export(path, args.out, args.dtype, args.force, args.overrides)
    remote = ", trust_remote_code=True" if report["architecture"] == "prism" else ""
    print(
        f"wrote {report['out']}: {report['architecture']}, {report['parameters']:,} parameters ({report['dtype']}), "
        f"step {report['step']}; load with AutoModelForCausalLM.from_pretrained({report['out']!r}{remote})"
    )
    print(f"MLflow: {json.dumps(report['mlflow'])}")
    return 0

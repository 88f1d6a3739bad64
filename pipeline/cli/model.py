"""`prism model report CONFIG`: pipeline.model.report on the command line."""

from __future__ import annotations

import argparse
import time


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="inspect the megatron-core model a config builds")
    p.set_defaults(func=run)
    verbs = p.add_subparsers(dest="model_verb", required=True, metavar="ACTION")
    r = verbs.add_parser("report", help="per-layer heads, d_h, params and FLOPs; checks against the uniform twin")
    r.add_argument("config", help="YAML preset, e.g. configs/prism_124m.yaml")
    r.add_argument("overrides", nargs="*", help="dotted overrides, e.g. schedule.heads=3x2,6x2,8x2,12x6")


def run(args: argparse.Namespace) -> int:
    from pipeline.config import load
    from pipeline.distributed import train_device
    from pipeline.model import sdpa_backend
    from pipeline.model.report import count, format_report, neutrality_checks, uniform_twin

    start = time.perf_counter()
    cfg = load(args.config, args.overrides)
    twin = uniform_twin(cfg)
    device = train_device(cfg)  # the kernels are torch's answer on this machine: run it where the job runs
    kernels = [sdpa_backend.layer_kernels(c, device) for c in (cfg, twin)]  # a pinned one that can't run: exit 2
    ours, theirs = count(cfg), count(twin)
    print(format_report(cfg, ours, "model", kernels[0]))
    print()
    print(format_report(twin, theirs, "uniform twin", kernels[1]))
    print()
    for c, k, name in ((cfg, kernels[0], "model"), (twin, kernels[1], "uniform twin")):
        if k:
            print(f"{name}: {sdpa_backend.kernel_line(c, k, device)}")
            if warning := sdpa_backend.fallback_warning(c, k, device):
                print(f"{name}: warning: {warning}")
    ok = True
    for name, (a, b) in neutrality_checks(cfg, ours, theirs).items():
        same = a == b
        ok &= same
        shown = f"{a:,}" if isinstance(a, int) else ("equal" if same else f"{a} vs {b}")
        print(f"check {name:<26} {'identical' if same else 'DIFFERENT'} ({shown})")
    print(f"neutral: {'yes' if ok else 'NO'} ({time.perf_counter() - start:.1f} s, counted on the meta device)")
    return 0 if ok else 1

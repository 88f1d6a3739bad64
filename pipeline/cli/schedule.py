"""`prism schedule validate | show | enumerate`: the head schedule from the command line."""

from __future__ import annotations

import argparse
import sys
import time

from pipeline import model_size, schedule
from pipeline.exit_codes import EXIT_BAD_INPUT


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schedule", help="validate, show or enumerate Prism head schedules")
    p.set_defaults(func=run)
    verbs = p.add_subparsers(dest="schedule_verb", required=True, metavar="ACTION")

    v = verbs.add_parser("validate", help="check a schedule against the rules; exit 0 or 2")
    v.add_argument("config", nargs="?", help="YAML config (or give the shape with the flags below)")
    v.add_argument("overrides", nargs="*", help="dotted overrides of CONFIG, e.g. parallel.tp=2")
    _shape_args(v)
    v.add_argument("--heads", help="per-layer heads: '3,3,6,6,...', '3x2,6x2,...' or a preset name")
    v.add_argument(
        "--allow-guideline-violations", action="store_true", help="report stage-length and baseline rules as warnings"
    )

    s = verbs.add_parser("show", help="per-layer heads, d_h, FLOPs, params and the neutrality checks")
    s.add_argument("config", help="YAML preset, e.g. configs/tiny_prism.yaml")
    s.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=2")

    e = verbs.add_parser("enumerate", help="every schedule that satisfies all rules")
    _shape_args(e)
    e.add_argument("--limit", type=int, default=0, help="print at most N schedules (the count is always full)")


def run(args: argparse.Namespace) -> int:
    return {"validate": _validate, "show": _show, "enumerate": _enumerate}[args.schedule_verb](args)


def _shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--d-model", type=int, help="model width (with --layers and --h-base instead of a CONFIG)")
    p.add_argument("--layers", type=int, help="number of layers L")
    p.add_argument("--h-base", type=int, help="the baseline head count (the last layer's)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size: every head count must be a multiple")


def _need_shape(args: argparse.Namespace) -> None:
    missing = [f"--{n.replace('_', '-')}" for n in ("d_model", "layers", "h_base") if getattr(args, n) is None]
    if missing:
        raise SystemExit(f"prism schedule: error: give a CONFIG or {' '.join(missing)}")


def _validate(args: argparse.Namespace) -> int:
    if args.config:
        return _validate_config(args)
    _need_shape(args)
    if not args.heads:
        raise SystemExit("prism schedule validate: error: give --heads (or a CONFIG)")
    d_model, layers, h_base, tp = args.d_model, args.layers, args.h_base, args.tp
    heads = schedule.resolve(args.heads)
    if len(heads) != layers:
        print(
            f"error: rule 'layers': the schedule lists {len(heads)} layers, the model has {layers}",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    verdict = schedule.judge(heads, d_model, h_base, tp, allow_guideline_violations=args.allow_guideline_violations)
    for p in verdict.violations:
        print(("error: " if p in verdict.errors else "warning (allowed): ") + str(p), file=sys.stderr)
    if verdict.errors:
        return EXIT_BAD_INPUT
    _print_valid(verdict, d_model, layers, h_base, tp, int(round(8 * d_model / 3)), 1024)
    return 0


def _validate_config(args: argparse.Namespace) -> int:
    """The verdict the config carries: it was judged at load with the config's TP size and replication opt-in,
    so this accepts exactly what `prism train` accepts. The flags become the overrides they stand for."""
    from pipeline import config

    flags = [f"schedule.heads={args.heads}"] if args.heads else []
    flags += [f"parallel.tp={args.tp}"] if args.tp != 1 else []
    flags += ["schedule.allow_guideline_violations=true"] if args.allow_guideline_violations else []
    cfg = config.load(args.config, [*args.overrides, *flags])  # a broken rule: one line, exit 2
    verdict, m = cfg.schedule_verdict, cfg.model
    for p in verdict.warnings:
        print(f"warning (allowed): {p}", file=sys.stderr)
    _print_valid(verdict, m.d_model, m.num_layers, m.h_base, cfg.parallel.tp, m.ffn_hidden_size, m.seq_len)
    return 0


def _print_valid(verdict: schedule.Verdict, d_model: int, layers: int, h_base: int, tp: int, ffn: int, seq: int):
    print(
        f"schedule {schedule.compact(verdict.heads)} is valid for d_model={d_model}, {layers} layers, "
        f"h_base={h_base}, TP={tp}"
    )
    replicated = [layer.number for layer in verdict.layers if layer.replicated]
    if replicated:
        print(
            f"layer(s) {', '.join(map(str, replicated))} run replicated on every TP rank "
            "(parallel.replicate_indivisible_layers)"
        )
    print(schedule.layer_table(verdict.heads, d_model, ffn, seq))


def _show(args: argparse.Namespace) -> int:
    from pipeline import config

    cfg = config.load(args.config, args.overrides)
    m = cfg.model
    heads = cfg.heads_per_layer
    twin = (m.h_base,) * m.num_layers
    print(f"{cfg.source}: {cfg.run.arm} arm, schedule {schedule.compact(heads)}")
    print(schedule.layer_table(heads, m.d_model, m.ffn_hidden_size, m.seq_len, gated=m.activation == "swiglu"))
    totals = {}
    for name, hs in (("schedule", heads), ("uniform twin", twin)):
        # the model's own figures (padded vocab, its activation and norms): what `prism plan` and the MFU use
        params, flops = model_size.parameter_count(cfg, hs), model_size.flops_per_token(cfg, hs)
        totals[name] = (params, flops)
        print(f"{name:>13}: {schedule.compact(hs):<22} parameters {params:>14,}  training FLOPs/token {flops:>16,}")
    (p1, f1), (p2, f2) = totals.values()
    print(
        f"neutrality: parameters {'PASS' if p1 == p2 else 'FAIL'} ({p1 - p2:+,}), "
        f"FLOPs {'PASS' if f1 == f2 else 'FAIL'} ({f1 - f2:+,})"
    )
    return 0 if (p1, f1) == (p2, f2) else 1


def _enumerate(args: argparse.Namespace) -> int:
    _need_shape(args)
    t0 = time.perf_counter()
    found = list(schedule.enumerate_valid(args.d_model, args.layers, args.h_base, args.tp))
    dt = time.perf_counter() - t0
    for heads in found[: args.limit or None]:
        print(schedule.compact(heads))
    print(
        f"{len(found)} valid schedules for d_model={args.d_model}, {args.layers} layers, "
        f"h_base={args.h_base}, TP={args.tp} ({dt * 1000:.1f} ms)"
    )
    return 0

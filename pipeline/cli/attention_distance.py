"""`prism attention-distance CHECKPOINT... [--compare OTHER...] --split val --sequences N`."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("attention-distance", help="per-layer attention distance D_l (Eq. 1) and ΔD_l")
    p.add_argument(
        "checkpoints",
        nargs="+",
        metavar="CHECKPOINT",
        help="tag or checkpoint folders (several: seeds); KEY=VALUE items override paths, e.g. data.dataset_dir=PATH",
    )
    p.add_argument(
        "--compare",
        nargs="+",
        default=[],
        metavar="OTHER",
        help="checkpoints of the other arm: writes ΔD_l = D_l(Prism) - D_l(uniform)",
    )
    p.add_argument("--split", default="val", help="dataset split the sequences come from (default val)")
    p.add_argument("--sequences", type=int, default=16, help="N sequences averaged per checkpoint")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when available")
    p.add_argument("--out", help="output folder (default <run_dir>/analysis of the first checkpoint)")
    p.add_argument(
        "--step", type=int, help="each run's checkpoint at this step (a milestone: both arms at equal tokens)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.analysis.checkpoints import measure_checkpoints

    overrides = [a for a in args.checkpoints + args.compare if "=" in a]
    paths = [a for a in args.checkpoints if "=" not in a]
    others = [a for a in args.compare if "=" not in a]
    if args.step is not None:
        from pipeline.checkpoint import resolve_tag_dir

        paths, others = ([str(resolve_tag_dir(p, args.step)) for p in group] for group in (paths, others))
    result = measure_checkpoints(paths, others, args.split, args.sequences, args.out, args.device, overrides)
    for r in result["checkpoints"]:
        print(f"{r['name']} ({r['meta']['split']}, {r['meta']['sequences']} sequences, T={r['meta']['seq_len']})")
        print(f"{'layer':>5} {'heads':>5} {'d_h':>4} {'D_l':>9} {'std':>8}")
        for row in r["rows"]:
            print(f"{row['layer']:>5} {row['heads']:>5} {row['head_dim']:>4} {row['D']:>9.3f} {row['std']:>8.3f}")
        print(f"wrote {', '.join(str(f) for f in r['files'])}; MLflow: {r['mlflow']['logged']}")
    if "delta" in result:
        print("ΔD_l = D_l(Prism) - D_l(uniform)")
        print(f"{'layer':>5} {'h_prism':>7} {'h_unif':>6} {'delta':>9} {'se':>8}")
        for row in result["delta"]["rows"]:
            print(
                f"{row['layer']:>5} {row['heads_prism']:>7} {row['heads_uniform']:>6} {row['delta']:>9.3f} "
                f"{row['delta_se']:>8.3f}"
            )
        print(f"wrote {', '.join(str(f) for f in result['delta']['files'])}")
    return 0

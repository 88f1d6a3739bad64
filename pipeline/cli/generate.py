"""`prism generate MODEL --prompt TEXT`: sample from an export folder or a checkpoint with transformers."""

from __future__ import annotations

import argparse

from pipeline.config import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a continuation of a prompt (transformers generate, KV cache)")
    p.add_argument("model", help="a `prism export` folder, or a checkpoint (tag, checkpoint or run folder)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.8, help="0 decodes greedily")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.export.generate import generate

    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise ConfigError("--temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1 are needed")
    generate(args.model, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    return 0

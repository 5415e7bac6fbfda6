"""`softprompt-plus` command line: `demo` (the README's main job) and `inspect ADAPTER`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence


def _demo(args) -> int:
    from .demo import main

    return main(args)


def _inspect(args) -> int:
    # Imported here so that `--help` stays instant: this pulls in torch and transformers.
    from .inspect_adapter import inspect_adapter

    try:
        report = inspect_adapter(args.adapter, base=args.base, top_k=args.top_k)
    except (ValueError, OSError) as err:
        print(f"softprompt-plus inspect: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="softprompt-plus", description="Exact, fast, tie-safe soft prompts for GPT-2-style models (PEFT)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="Prompt-tune a frozen tiny GPT-2 offline, then save, reload and generate.",
        description="Prompt-tune a frozen GPT-2 on a small counting task and score it on held-out numbers. "
        "Runs offline on an embedded tiny GPT-2 unless --model is given.",
    )
    demo.add_argument("--model", default=None, help="Path (or Hub id) of a real GPT-2 checkpoint to use instead.")
    demo.add_argument("--steps", type=int, default=150, help="Prompt-tuning steps (default 150).")
    demo.add_argument("--out", default=None, help="Where to save the adapter (default: a temp dir).")
    demo.add_argument("--seed", type=int, default=0, help="Random seed (default 0).")
    demo.set_defaults(func=_demo)

    inspect = sub.add_parser(
        "inspect",
        help="Show a saved adapter's config, prompt norms and nearest vocabulary tokens.",
        description="Print a softprompt-plus adapter's config, the L2 norm of each virtual token and, when a base "
        "model is available, the vocabulary tokens nearest to each virtual token (cosine similarity against the "
        "base model's input embedding matrix). The base defaults to the adapter config's base_model_name_or_path "
        "when that is a local folder.",
    )
    inspect.add_argument("adapter", help="Adapter folder written by save_pretrained, or a Hub repo id.")
    inspect.add_argument("--base", default=None, help="Base model folder (or Hub id) the adapter was trained on.")
    inspect.add_argument(
        "--top-k", type=_positive_int, default=5, help="Nearest tokens per virtual token (default 5)."
    )
    inspect.add_argument("--json", action="store_true", help="Print the report as JSON.")
    inspect.set_defaults(func=_inspect)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())

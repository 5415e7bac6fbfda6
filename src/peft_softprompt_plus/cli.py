"""`softprompt-plus` command line: `demo` (the README's main job) and `inspect ADAPTER`."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence


def _demo(args) -> int:
    from .demo import main

    return main(args)


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
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())

"""One vocabulary of flags for the CLI and the examples: `--model`, `--output-dir`, `--steps`, `--learning-rate`,
`--num-virtual-tokens`, `--batch-size`, `--seed`. `--output-dir` and `--learning-rate` are the Trainer's own names;
`--steps` because every job here runs exactly that many optimizer steps. The 0.2.0 CLI spellings (`--out`, `--lr`)
still parse, to the new flag, with a FutureWarning, until 0.4.0. Standard library only: the CLI checks arguments
before it imports torch."""

from __future__ import annotations

import argparse
import warnings

from .._moved import REMOVED_IN

VOCABULARY = (
    "--model",
    "--output-dir",
    "--steps",
    "--learning-rate",
    "--num-virtual-tokens",
    "--batch-size",
    "--seed",
)
RENAMED = {"--out": "--output-dir", "--lr": "--learning-rate"}  # the 0.2.0 CLI spelling -> this vocabulary's


class _Renamed(argparse.Action):
    """Stores the value under the new flag's name; warns when the command line used the old spelling."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in RENAMED:
            warnings.warn(
                f"`{option_string}` is now `{RENAMED[option_string]}` (the Trainer's name, used by every command and "
                f"example); `{option_string}` stops working in {REMOVED_IN}.",
                FutureWarning,
                stacklevel=2,
            )
        setattr(namespace, self.dest, values)


def add(parser: argparse.ArgumentParser, flag: str, **kwargs) -> None:
    """`parser.add_argument(flag, ...)`, also under the flag's old spelling where it had one (hidden from --help's
    usage line: the help text names it)."""
    old = [o for o, new in RENAMED.items() if new == flag]
    if old:
        kwargs["action"] = _Renamed
        kwargs["help"] = f"{kwargs.get('help', '')} (`{old[0]}` until {REMOVED_IN})".strip()
    parser.add_argument(flag, *old, **kwargs)

"""One vocabulary of flags (apps/flags.py): the CLI and every example spell a flag the same way; the 0.2.0 CLI
spellings still parse, to the new flag, with a FutureWarning naming both."""

import ast
import pathlib
import warnings

import pytest

from peft_softprompt_plus.apps import cli, flags

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Spellings of the vocabulary's ideas that no command or example may use (the Trainer's underscores, short forms).
OTHER_SPELLINGS = {"--out", "--lr", "--output_dir", "--learning_rate", "--max-steps", "--virtual-tokens",
                   "--num_virtual_tokens", "--outdir", "--output", "--n-tokens", "--tokens"}  # fmt: skip


def _parsers():
    parser = cli.build_parser()
    return parser._subparsers._group_actions[0].choices


def _example_flags() -> dict[str, set[str]]:
    found = {}
    for path in sorted((ROOT / "examples").glob("*.py")):
        calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]
        found[path.name] = {
            a.value
            for c in calls
            if getattr(c.func, "attr", None) == "add_argument"
            for a in c.args
            if isinstance(a, ast.Constant) and str(a.value).startswith("--")
        }
    return found


def test_no_command_or_example_spells_a_vocabulary_flag_another_way():
    shown = {
        name: {o for a in p._actions for o in a.option_strings if o not in flags.RENAMED}
        for name, p in _parsers().items()
    }
    shown.update(_example_flags())
    assert {name: sorted(f & OTHER_SPELLINGS) for name, f in shown.items() if f & OTHER_SPELLINGS} == {}
    assert all(f"`{flag}`" in (ROOT / "docs" / "api.md").read_text() for flag in flags.VOCABULARY)


@pytest.mark.parametrize(
    "argv, dest, value",
    [
        (["demo", "--out", "d"], "output_dir", "d"),
        (["distill", "--model", "m", "--system-prompt-file", "s", "--out", "o"], "output_dir", "o"),
        (["distill", "--model", "m", "--system-prompt-file", "s", "--output-dir", "o", "--lr", "0.5"], "lr", 0.5),
    ],
)
def test_an_old_cli_spelling_parses_to_the_new_flag_with_a_future_warning(argv, dest, value):
    old = next(a for a in argv if a in flags.RENAMED)
    with pytest.warns(FutureWarning, match=rf"`{old}` is now `{flags.RENAMED[old]}`.*stops working in 0\.4\.0"):
        args = cli.build_parser().parse_args(argv)
    assert getattr(args, dest) == value


def test_the_new_spelling_parses_silently():
    argv = ["distill", "--model", "m", "--system-prompt-file", "s", "--output-dir", "o", "--learning-rate", "0.5"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = cli.build_parser().parse_args(argv)
    assert (args.output_dir, args.lr) == ("o", 0.5)
    help_text = " ".join(_parsers()["distill"].format_help().split())
    assert "--output-dir" in help_text and "`--out` until 0.4.0" in help_text

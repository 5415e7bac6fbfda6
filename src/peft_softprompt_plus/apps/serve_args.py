"""`softprompt-plus serve`'s arguments, checked before anything heavy is imported (cli.py adds this subcommand)."""

from __future__ import annotations

import argparse
import ipaddress
import os

LOOPBACK = "127.0.0.1"


def _adapter(value: str) -> tuple[str, str]:
    name, sep, folder = value.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"`--adapter` takes NAME=FOLDER, got {value!r}.")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(
            f"`--adapter` {name}={folder!r}: no such folder. Pass a saved adapter folder."
        )
    return name, folder


def add_parser(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="Serve saved soft prompts by name in front of a running vLLM OpenAI server.",
        description="An OpenAI-compatible front (Completions, Chat Completions, streaming, /v1/models): a request's "
        "`model` names an adapter (or the base by its folder name); the front formats and tokenizes the text, builds "
        "the exact embeddings and forwards them to vLLM (started with --enable-prompt-embeds --dtype float32) as "
        "`prompt_embeds`. PUT/DELETE /v1/adapters/NAME adds, replaces or removes an adapter while it runs. Needs "
        "the `serve` extra. See docs/serving.md.",
    )
    serve.add_argument("--base", required=True, help="The base checkpoint folder vLLM serves (or 'smollm2').")
    serve.add_argument(
        "--adapter", type=_adapter, action="append", default=[], help="NAME=FOLDER, a saved adapter (repeatable)."
    )
    serve.add_argument("--upstream", default="http://127.0.0.1:8000", help="vLLM's URL (default 127.0.0.1:8000).")
    serve.add_argument(
        "--upstream-model",
        default=None,
        help="The model name vLLM serves (default: the --base path).",
    )
    serve.add_argument("--host", default=LOOPBACK, help="Address to bind (default 127.0.0.1, this machine only).")
    serve.add_argument("--port", type=int, default=8100, help="Port (default 8100).")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("SOFTPROMPT_PLUS_API_KEY"),
        help="Require `Authorization: Bearer KEY` (default: $SOFTPROMPT_PLUS_API_KEY, else none).",
    )
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="Base dtype.")
    serve.set_defaults(func=_serve)


def _serve(args) -> int:
    from .fetch import CHECKPOINTS as REAL_CHECKPOINTS

    if args.base not in REAL_CHECKPOINTS and not os.path.isdir(args.base):
        raise ValueError(f"`--base`={args.base!r} is not a folder. Pass the checkpoint folder vLLM serves.")
    try:
        public = not ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        public = args.host != "localhost"
    if public and not args.api_key:
        raise ValueError(
            f"`--host`={args.host!r} reaches beyond this machine: pass --api-key (or set SOFTPROMPT_PLUS_API_KEY) "
            "so that only your clients are served."
        )
    try:
        import fastapi  # noqa: F401
        import httpx  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise ValueError(
            f"serving needs the `serve` extra: pip install 'peft-softprompt-plus[serve]' ({err})."
        ) from err
    if args.base in REAL_CHECKPOINTS:
        from .fetch import fetch_checkpoint

        args.base = fetch_checkpoint(args.base)
    from .serve import main

    return main(args)

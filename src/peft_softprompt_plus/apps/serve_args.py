"""`softprompt-plus serve`'s arguments, checked before anything heavy is imported (cli.py adds this subcommand)."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import urllib.request

from ..serve.requests import HEALTH_INTERVAL_S, LOOPBACK_HOSTS, Limits

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


def _composition(value: str) -> tuple[str, list[str]]:
    name, sep, parts = value.partition("=")
    names = parts.split(",")
    if not sep or not name or len(names) < 2 or not all(names):
        raise argparse.ArgumentTypeError(
            f"`--compose` takes NAME=A,B[,...] (two or more loaded KV adapters' names), got {value!r}."
        )
    return name, names


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
    serve.add_argument(
        "--allow-adapter-updates",
        action="store_true",
        help="Allow PUT/DELETE /v1/adapters/NAME (local folders only; needs --api-key). Off by default.",
    )
    serve.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        help="A name the Host header may carry (repeatable), besides the loopback names a loopback front always "
        "answers to. A public front answers to any name unless some are given.",
    )
    serve.add_argument(
        "--kv-share",
        default=None,
        help="A folder vLLM's processes can read: KV adapters (prompt_level='kv') are published there by content hash "
        "for this package's KV connector. Without it, KV adapters are refused. The front prints vLLM's "
        "--kv-transfer-config for it.",
    )
    serve.add_argument(
        "--compose",
        type=_composition,
        action="append",
        default=[],
        help="NAME=A,B: serve the KV adapters A, B (loaded with --adapter) composed under NAME, their caches in this "
        "order, as set_adapter(['A', 'B']) reads them (repeatable).",
    )
    serve.add_argument(
        "--health-interval",
        type=_positive("--health-interval"),
        default=HEALTH_INTERVAL_S,
        help="Seconds one check of the engine and its KV connector is trusted: GET /health checks again, against the "
        f"engine as it is now, once it is older. Default {HEALTH_INTERVAL_S}.",
    )
    for f in dataclasses.fields(Limits):
        flag = "--" + f.name.replace("_", "-")
        serve.add_argument(
            flag, type=_positive(flag), default=f.default, help=f"{f.metadata['help']} Default {f.default}."
        )
    serve.set_defaults(func=_serve)


def _positive(flag: str):
    def parse(value: str) -> int:
        if not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"`{flag}` takes a positive integer, got {value!r}.")
        return int(value)

    return parse


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
    if args.allow_adapter_updates and not args.api_key:
        raise ValueError(
            "`--allow-adapter-updates` lets a client load any folder on this machine: pass --api-key (or set "
            "SOFTPROMPT_PLUS_API_KEY) so that only your clients can."
        )
    if args.kv_share is not None:
        from ..serve.share import FOLDER_MODE, check_folder

        os.makedirs(args.kv_share, mode=FOLDER_MODE, exist_ok=True)
        check_folder(args.kv_share)
    given = tuple(h.lower() for h in args.allowed_host)
    # A loopback front always answers to loopback names; a public one to any name unless some are given.
    args.allowed_hosts = (None if not given else given) if public else LOOPBACK_HOSTS + given
    args.limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})
    args.engine_version = _engine_version(args.upstream)
    try:
        import fastapi  # noqa: F401
        import httpx  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise ValueError(
            f"serving needs the `serve` extra: pip install 'peft-softprompt-plus[serve]' ({err})."
        ) from err
    if args.base in REAL_CHECKPOINTS:
        from .fetch import fetch_checkpoint

        args.base = fetch_checkpoint(args.base)
    from ..serve.app import main

    return main(args)


def _engine_version(upstream: str):
    """vLLM's version from its `/version` (None while it can't be reached: the newest measured rule applies)."""
    try:
        with urllib.request.urlopen(upstream.rstrip("/") + "/version", timeout=5) as answer:
            return json.loads(answer.read()).get("version")
    except (OSError, ValueError, AttributeError):
        return None

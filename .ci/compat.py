#!/usr/bin/env python3
"""Run the test suite in a fresh virtual environment against a chosen set of dependency versions.

    python .ci/compat.py pinned              # .ci/constraints.txt, what CI installs (the README's test command)
    python .ci/compat.py newest              # the newest release of every dependency the index serves
    python .ci/compat.py lowest              # every lower bound setup.cfg declares, installed exactly
    python .ci/compat.py newest --pin transformers==5.19.0   # one package held at a version (vLLM's pin)
    python .ci/compat.py newest --write-constraints          # refresh the CI pins when the newest pass

It prints the versions it got and one Markdown row for docs/integrations.md's compatibility table. torch stays at the
CPU build `torch==2.13.0` in every mode unless `--torch` says otherwise: a newer torch from the index is a CUDA build
of several GB. Arguments after `--` go to pytest (default: the whole suite, slow tests included).
"""

from __future__ import annotations

import argparse
import configparser
import datetime
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / ".ci" / "constraints.txt"
SHOWN = ["torch", "transformers", "peft", "accelerate", "bitsandbytes", "kernels", "huggingface_hub", "trl"]
# The runtime dependencies whose declared lower bound `lowest` installs exactly (test-only tools stay newest).
LOWEST = ["torch", "transformers", "peft", "accelerate", "bitsandbytes"]


def declared_lower_bounds() -> dict[str, str]:
    """`name -> version` for every `name>=version` in setup.cfg's install_requires and the `bnb` extra."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines() + cfg["options.extras_require"]["bnb"].splitlines()
    bounds = {}
    for line in lines:
        found = re.match(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([^,\s]+)", line)
        if found:
            bounds[found[1].lower()] = found[2]
    return bounds


def constraints_for(mode: str, pins: list[str], torch: str) -> list[str]:
    lines = {"pinned": lambda: CONSTRAINTS.read_text().splitlines(), "newest": list, "lowest": list}[mode]()
    if mode == "lowest":
        bounds = declared_lower_bounds()
        lines = [f"{name}=={bounds[name]}" for name in LOWEST if name in bounds]
    held = {re.split(r"[=<>!~ ]", p, maxsplit=1)[0].lower() for p in [*pins, torch]}
    kept = [line for line in lines if re.split(r"[=<>!~ ]", line, maxsplit=1)[0].lower() not in held]
    return [*kept, *pins, torch]


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["pinned", "newest", "lowest"])
    parser.add_argument("--pin", action="append", default=[], help="hold a package, e.g. transformers==5.19.0")
    parser.add_argument("--torch", default="torch==2.13.0", help="the torch requirement (default: the CPU build)")
    parser.add_argument(
        "--write-constraints", action="store_true", help="when the suite passes, copy the versions into the CI pins"
    )
    parser.add_argument("--venv", help="where to build the environment (default: a fresh temporary folder)")
    args, pytest_args = parser.parse_known_args(argv)
    pytest_args = [a for a in pytest_args if a != "--"] or ["-q", "-m", "slow or not slow"]

    venv = Path(args.venv or tempfile.mkdtemp(prefix=f"softprompt-plus-{args.mode}-"))
    run([sys.executable, "-m", "venv", "--clear", str(venv)])
    # The suite runs on a clone of HEAD, so edits made while it runs can't mix into the result
    # (commit first: uncommitted changes are not in the clone).
    tree = venv / "tree"
    run(["git", "clone", "-q", str(ROOT), str(tree)])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True).stdout
    python = str(venv / "bin" / "python")
    constraints = venv / "constraints.txt"
    constraints.write_text("\n".join(constraints_for(args.mode, args.pin, args.torch)) + "\n")
    run([python, "-m", "pip", "install", "-q", args.torch])
    run([python, "-m", "pip", "install", "-q", "-c", str(constraints), "-e", f"{tree}[test]"])

    freeze = subprocess.run([python, "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
    got = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", freeze, flags=re.M))
    got = {name.lower().replace("-", "_"): version for name, version in got.items()}
    versions = {name: got.get(name, "-") for name in SHOWN}
    print("versions:", ", ".join(f"{k} {v}" for k, v in versions.items()), flush=True)

    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    log = venv / "pytest.log"  # `tail -f` it to follow the run
    print(f"+ pytest {' '.join(pytest_args)} > {log}", flush=True)
    with open(log, "w") as out:
        done = subprocess.run([python, "-m", "pytest", *pytest_args], cwd=tree, env=env, stdout=out, stderr=out)
    output = log.read_text()
    sys.stdout.write(output[-6000:])
    summary = next((line for line in reversed(output.splitlines()) if re.search(r"\d+ (passed|failed)", line)), "")
    summary = summary.strip("= ").strip()
    label = args.mode + "".join(f" {p}" for p in args.pin)
    row = [
        datetime.date.today().isoformat(),
        commit.strip(),
        label,
        *versions.values(),
        summary or f"pytest exit {done.returncode}",
    ]
    print("| " + " | ".join(row) + " |")
    if args.write_constraints and done.returncode == 0:
        header = [line for line in CONSTRAINTS.read_text().splitlines() if line.startswith("#")]
        pins = [line.replace("+cpu", "") for line in freeze.splitlines() if "==" in line and "softprompt" not in line]
        CONSTRAINTS.write_text("\n".join([*header, *pins]) + "\n")
        print(f"wrote {CONSTRAINTS.relative_to(ROOT)}: review the diff and commit it")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())

"""`python -m peft_softprompt_plus` runs the CLI (`demo` by default)."""

import sys

from .apps.cli import main

raise SystemExit(main(sys.argv[1:] or ["demo"]))

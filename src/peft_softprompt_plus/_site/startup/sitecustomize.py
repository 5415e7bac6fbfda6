"""Put first on PYTHONPATH by `softprompt-plus run`: registers peft-softprompt-plus with PEFT in this process (and the
processes it starts) the moment PEFT is imported, then runs the `sitecustomize` this file shadows, if there is one."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))

try:
    from peft_softprompt_plus._site import hook as _hook
except ImportError:  # an interpreter without the package (another environment started by the program)
    _hook = None
if _hook is not None:
    _hook.install()


def _run_shadowed() -> None:
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = module_from_spec(spec)
        spec.loader.exec_module(module)


_run_shadowed()

"""The module paths of 0.2.0 that moved to a layer in 0.3.0. Each still imports, as the new module, with a
FutureWarning at the user's import line, until 0.4.0. Standard library only: the package's `__init__` installs this
at import.

A FutureWarning, not a DeprecationWarning: under Python's default filters a DeprecationWarning shows only when it is
raised from `__main__` (PEP 565), so an old path imported from a user's own module would stay silent."""

import importlib
import os
import sys
import warnings
from importlib.machinery import ModuleSpec

PACKAGE = "peft_softprompt_plus"
REMOVED_IN = "0.4.0"
MOVED = {  # 0.2.0 module -> its 0.3.0 home (`distill` is now the distillation package itself: see distill/__init__.py)
    "config": "method.config",
    "tuner": "method.tuner",
    "prompt_bank": "method.prompt_bank",
    "prompt_init": "method.prompt_init",
    "reparam": "method.reparam",
    "tying": "method.tying",
    "precision": "method.precision",
    "tasks": "method.tasks",
    "routing": "forward.routing",
    "validation": "forward.validation",
    "semantics": "forward.semantics",
    "forward_paths": "forward.paths",
    "attention": "forward.attention",
    "generation": "forward.generation",
    "prompted": "forward.prompted",
    "gradient_flow": "gradients.flow",
    "gradient_checks": "gradients.causes",
    "gradient_evidence": "gradients.evidence",
    "gradient_report": "gradients.findings",
    "callbacks": "gradients.callbacks",
    "saving": "files.saving",
    "loading": "files.loading",
    "hub": "files.hub",
    "model_card": "files.model_card",
    "inspect_adapter": "files.inspect_adapter",
    "_peft_registry": "integrations.peft_registry",
    "_registration": "integrations.registration",
    "serving": "serve.embeds",
    "distill_data": "distill.data",
    "distill_score": "distill.score",
    "distill_teacher": "distill.teacher",
    "demo": "apps.demo",
    "capitals": "apps.capitals",
    "fetch": "apps.fetch",
    "tiny": "apps.tiny",
    "cli": "apps.cli",
}


_HERE = os.path.dirname(os.path.abspath(__file__))


def user_stacklevel(libraries: tuple[str, ...] = (), helpers: int = 0) -> int:
    """The `stacklevel` of the first frame outside importlib, this package and the folders `libraries` (torch,
    PEFT...): the user's own line, for the `warnings.warn` of the function that calls this (through `helpers` frames
    of its own). `warnings` itself skips importlib's bootstrap frames without counting them; so does this."""
    frame, level = sys._getframe(2 + helpers), 2  # level 2: the caller of the function that warns
    while frame is not None:
        name = frame.f_code.co_filename
        internal = "importlib" in name and "_bootstrap" in name  # as `warnings` tells them
        ours = name.startswith((_HERE, *libraries)) or os.path.basename(os.path.dirname(name)) == "importlib"
        if not internal and not ours:
            return level
        frame, level = frame.f_back, level + (0 if internal else 1)
    return level


def warn_moved(old: str, new: str) -> None:
    warnings.warn(
        f"`{old}` moved to `{new}` in 0.3.0; the old path works until {REMOVED_IN}. Import the new path, or the "
        f"public names from `{PACKAGE}` itself.",
        FutureWarning,
        stacklevel=user_stacklevel(),
    )


class _Alias:
    """A loader whose module is the moved module itself: one module object under both names."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        warn_moved(spec.name, self.new)
        module = importlib.import_module(self.new)
        self.real_spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = (
            self.real_spec
        )  # importlib set the alias's spec on the shared module; the module keeps its own


class MovedFinder:
    """Last on `sys.meta_path`: asked only for names no other finder knows, so it costs current imports nothing."""

    def find_spec(self, fullname, path, target=None):
        old = fullname[len(PACKAGE) + 1 :] if fullname.startswith(PACKAGE + ".") else None
        if old not in MOVED:
            return None
        return ModuleSpec(fullname, _Alias(f"{PACKAGE}.{MOVED[old]}"))


def install() -> None:
    if not any(type(f).__name__ == "MovedFinder" for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())

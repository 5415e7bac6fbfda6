"""Registers the method with PEFT the moment PEFT is imported, without importing anything heavy before that.

`install()` puts a finder on `sys.meta_path`: once the `peft` package has run, it imports
`peft_softprompt_plus.integrations.registration`; and before any heavy module of this package runs, it imports
`peft` first,
so registration never meets a half-imported module of ours. Standard library only: this runs at interpreter
start-up under `softprompt-plus run` and the opt-in `.pth` hook.
"""

import sys

PACKAGE = "peft_softprompt_plus"
REGISTRATION = f"{PACKAGE}.integrations.registration"
# Modules of ours that run without PEFT (the command line checks its arguments before any heavy import).
LIGHT = {
    PACKAGE,
    *(
        f"{PACKAGE}.{name}"
        for name in (
            "__main__",
            "_names",
            "_moved",
            "_site",
            "apps",
            "apps.cli",
            "apps.fetch",
            "apps.serve_args",
            "serve",
            "serve.requests",
            "apps.distill_args",
            "apps.flags",
            "distill",
            "distill.refusals",
            "distill.options",
            "distill.content",
        )
    ),
    *(f"{PACKAGE}.{layer}" for layer in ("method", "forward", "gradients", "files", "integrations")),
}


def import_module(name: str):
    import importlib

    return importlib.import_module(name)


def register_now() -> None:
    """Import PEFT (the finder then registers) or, when it is already imported, register directly."""
    import_module("peft")
    import_module(REGISTRATION)


class _RegisterAfter:
    """PEFT's own loader, followed by our registration once its package code has run."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            import_module(REGISTRATION)
        except Exception as err:  # noqa: BLE001 - `import peft` must keep working whatever happens to us
            import warnings

            warnings.warn(
                f"peft-softprompt-plus could not register with PEFT: {type(err).__name__}: {err}", stacklevel=2
            )


class PeftFinder:
    """A meta path finder (duck-typed: importlib.abc alone would cost more start-up time than all of this)."""

    def find_spec(self, fullname, path, target=None):
        if fullname == "peft":
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None and spec.loader is not None:
                    spec.loader = _RegisterAfter(spec.loader)
                    return spec
            return None
        ours = fullname.startswith(PACKAGE + ".") and not fullname.startswith(f"{PACKAGE}._site")
        if ours and fullname not in LIGHT and "peft" not in sys.modules:
            import_module("peft")  # registers; this module then imports against a complete PEFT
        return None


def install() -> None:
    """Register now if PEFT is already imported; otherwise when it is. Idempotent."""
    if "peft" in sys.modules:
        import_module(REGISTRATION)
        return
    if not any(isinstance(f, PeftFinder) or type(f).__name__ == "PeftFinder" for f in sys.meta_path):
        sys.meta_path.insert(0, PeftFinder())

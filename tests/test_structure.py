"""The package's shape (docs/architecture.md): layers that import only the layers above them, no import cycles
(counting imports inside functions), no arrow from the core to an application, only
`integrations/peft_registry.py` changes PEFT, the README's layout lists every module, and the 0.2.0 module paths
still import (with a FutureWarning at the user's line)."""

import ast
import importlib
import os
import pathlib
import re
import subprocess
import sys
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "peft_softprompt_plus"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
    """Every module of the package that `name` imports anywhere in its body, functions included."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def test_no_import_cycles_even_inside_functions():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state, cycles = {}, []

    def visit(node, trail):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(trail[trail.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, trail + [dep])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
    assert graph["peft_softprompt_plus._names"] == set()  # the leaf every module may import


def test_only_the_registry_changes_peft():
    # Assigning to a PEFT attribute or registering a method happens in one visible place.
    pattern = re.compile(r"setattr\(\s*(peft|PeftModel|patch\.owner)|register_peft_method|_extend_str_enum\(PeftType")
    writers = {p.name for p in PACKAGE.rglob("*.py") if pattern.search(p.read_text())}
    assert writers == {"peft_registry.py"}


@pytest.mark.parametrize("page, heading", [("README.md", "## Layout"), ("docs/architecture.md", "## Layers")])
def test_the_layout_maps_list_every_module(page, heading):
    text = (ROOT / page).read_text()
    layout = text[text.index(heading) :]
    missing = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if f"`{p.name}`" not in layout]
    missing += [
        f"{d.name}/" for d in PACKAGE.iterdir() if (d / "__init__.py").exists() and f"`{d.name}/`" not in layout
    ]
    assert missing == [], f"{page}'s layout misses {missing}"


# The layers, top to bottom: a module may import its own layer and any layer listed before it, never one after.
LAYERS = [
    "_names",
    "_site",
    "_moved",
    "method",
    "forward",
    "gradients",
    "files",
    "integrations",
    "distill",
    "serve",
    "apps",
]
# Where a lower layer reaches a higher one on purpose, module by module, each with its reason:
UPWARD = {
    # The tuner is the object PEFT instantiates: it composes the forward, the attach probe and the files.
    ("method.tuner", "forward"),
    ("method.tuner", "gradients"),
    ("method.tuner", "files"),
    # A task record names the forward pieces that task uses (its loss, its pooled position).
    ("method.tasks", "forward"),
    # Starting a prompt from a saved adapter reads it with the files layer's checked reader.
    ("method.prompt_init", "files"),
    # A KV prompt's start is the input prompt its init names, run once through the frozen model; lifting or copying
    # a saved adapter reads it with the files layer's checked reader.
    ("method.kv_init", "forward"),
    ("method.kv_init", "files"),
    # The demonstrations start checks its context against the model's positions and window, and reads the layout.
    ("method.demonstrations", "forward"),
    # The selection's scorer reads each attention layer's weights through the layout.
    ("method.kv_select", "forward"),
    # A call with gradients disabled is reported through the probe's one warning.
    ("forward.prompted", "gradients"),
}


def _layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_layers_import_only_the_layers_above_them():
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        here = _layer(name)
        if here not in LAYERS:
            continue
        for dep in _imports(name, path, modules):
            there = _layer(dep)
            allowed = (name.split(".", 1)[1], there) in UPWARD
            if there in LAYERS and LAYERS.index(there) > LAYERS.index(here) and not allowed:
                wrong.append(f"{name} -> {dep}")
    assert wrong == []


def test_no_arrow_from_the_core_to_an_application():
    modules = _modules()
    wrong = [
        f"{name} -> {dep}"
        for name, path in modules.items()
        if _layer(name) not in ("apps", "__main__")  # `python -m peft_softprompt_plus` is the CLI's launcher
        for dep in _imports(name, path, modules)
        if _layer(dep) == "apps"
    ]
    assert wrong == []


def test_no_module_reaches_into_another_layer_s_private_names():
    # A name with one leading underscore is its layer's own: `tuner._active()` from forward/ would pass the import
    # checks unseen. Flagged: an attribute `._x` read in one layer where `_x` is defined (a function, method or
    # class) only in others, and `from ... import _x` across layers.
    defined, trees = {}, {}
    for path in PACKAGE.rglob("*.py"):
        trees[path] = tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and re.fullmatch(r"_[a-z]\w*", node.name):
                defined.setdefault(node.name, set()).add(_path_layer(path))
    wrong = []
    for path, tree in trees.items():
        here = _path_layer(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and here not in defined.get(node.attr, {here}):
                wrong.append(f"{path.relative_to(PACKAGE)}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.ImportFrom) and node.level and node.module:
                base = path.parents[node.level - 1]  # `.` is the module's own package, `..` the one above
                there = (base / node.module.replace(".", "/")).resolve()
                privates = [a.name for a in node.names if re.fullmatch(r"_[a-z]\w*", a.name)]
                if privates and _path_layer(there.with_suffix(".py")) != here:
                    wrong.append(f"{path.relative_to(PACKAGE)}:{node.lineno} imports {privates}")
    assert wrong == []


def _path_layer(path) -> str:
    parts = path.resolve().relative_to(PACKAGE.resolve()).parts
    return parts[0] if len(parts) > 1 else path.stem


def test_the_lazy_tables_reach_the_applications_they_are_documented_to():
    # importlib arrows are invisible to the import-statement checks above: the tables that hold them are read here.
    import peft_softprompt_plus
    from peft_softprompt_plus import distill

    targets = {f"peft_softprompt_plus.{m}" for m in peft_softprompt_plus._PUBLIC.values()} | set(distill._OLD.values())
    to_apps = sorted(t for t in targets if _layer(t) == "apps")
    assert to_apps == ["peft_softprompt_plus.apps.distill_job", "peft_softprompt_plus.apps.fetch"]
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert all(f"`{t.split('.')[-1]}.py`" in text for t in to_apps)  # each one argued in architecture.md


def test_importing_the_package_loads_no_application_and_no_layer():
    code = (
        "import sys, peft_softprompt_plus, peft, peft_softprompt_plus as p; p.SoftPromptPlusConfig; "
        "print(sorted(m for m in sys.modules if m.startswith('peft_softprompt_plus.')))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "apps" not in loaded and "distill" not in loaded and "gradients.callbacks" not in loaded, loaded
    assert "peft_softprompt_plus.method.config" in loaded  # the check can see a loaded module


MOVED_SAMPLE = {  # a 0.2.0 path, and a name it held
    "peft_softprompt_plus.tuner": "SoftPromptPlusModel",
    "peft_softprompt_plus.gradient_flow": "check_gradient_flow",
    "peft_softprompt_plus.tiny": "tiny_gpt2",
    "peft_softprompt_plus.cli": "main",
    "peft_softprompt_plus._peft_registry": "PATCHES",
}


@pytest.mark.parametrize("old", sorted(MOVED_SAMPLE))
def test_a_0_2_module_path_still_imports_with_a_future_warning(old):
    sys.modules.pop(old, None)
    with pytest.warns(FutureWarning, match=r"moved to .* until 0\.4\.0"):
        module = importlib.import_module(old)
    assert hasattr(module, MOVED_SAMPLE[old])
    assert module.__name__ != old  # the module itself, under its new name (one copy of its state)
    assert sys.modules[module.__name__] is module


def test_every_moved_path_names_a_module_that_exists():
    from peft_softprompt_plus._moved import MOVED

    assert len(MOVED) == 36
    missing = [new for new in MOVED.values() if not (PACKAGE / (new.replace(".", "/") + ".py")).exists()]
    assert missing == []


def test_the_old_distill_module_names_still_resolve():
    import peft_softprompt_plus.distill as distill

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from peft_softprompt_plus.distill import distill_prompt, main
    assert distill_prompt.__module__ == "peft_softprompt_plus.distill.run"
    assert main.__module__ == "peft_softprompt_plus.apps.distill_job"
    ours = [w for w in caught if "moved to" in str(w.message)]
    assert [w.category for w in ours] == [FutureWarning, FutureWarning]
    assert {w.filename for w in ours} == {__file__}  # at the importing line, not inside the package
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        getattr(distill, "nothing")  # noqa: B009


def test_the_tests_mirror_the_layers():
    folders = {d.name for d in (ROOT / "tests").iterdir() if d.is_dir() and not d.name.startswith((".", "_"))}
    layers = {d.name for d in PACKAGE.iterdir() if (d / "__init__.py").exists() and not d.name.startswith("_")}
    assert folders == layers


# Private attributes a module may write on an object that isn't its own, each with its reason.
FOREIGN_WRITES = {
    ("method/tuner.py", "self.prompt_bank._active_adapter"),  # PEFT's BaseTunerLayer field, as PEFT's tuners set it
    ("method/precision.py", "module._softprompt_plus_casts_input"),  # our mark on a base module, namespaced
    ("integrations/peft_registry.py", "member._name_"),  # the PeftType member: the one place that changes PEFT
    ("integrations/peft_registry.py", "member._value_"),
    ("integrations/peft_registry.py", "enum_cls._member_map_"),
    ("integrations/peft_registry.py", "enum_cls._value2member_map_"),
    ("integrations/peft_registry.py", "replacement._softprompt_plus_original"),
    ("forward/attention_owner.py", "model.config._attn_implementation"),  # where `set_attn_implementation` is absent
}


def test_no_module_writes_another_s_private_attributes():
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in (t for t in targets if t is not None):
                for sub in ast.walk(target):
                    if not isinstance(sub, ast.Attribute) or not sub.attr.startswith("_") or sub.attr.endswith("__"):
                        continue
                    if isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls"):
                        continue
                    found.add((str(path.relative_to(PACKAGE)), ast.unparse(sub)))
    assert found <= FOREIGN_WRITES, sorted(found - FOREIGN_WRITES)
    assert not any("tuner._" in write for _, write in found)  # the forward's state has one owner


def test_importing_registers_the_method_and_installs_nothing_until_attach():
    code = (
        "import peft_softprompt_plus, peft\n"
        "from transformers.loss.loss_utils import LOSS_MAPPING\n"
        "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as KERNELS\n"
        "from peft_softprompt_plus import SoftPromptPlusConfig\n"
        "from peft_softprompt_plus.apps.tiny import tiny_gpt2\n"
        "seen = lambda: ('softprompt_plus_sdpa' in KERNELS.valid_keys(), 'ForSoftPromptedCausalLM' in LOSS_MAPPING)\n"
        "print('SOFTPROMPT_PLUS' in peft.PeftType.__members__, *seen())\n"
        "model = peft.get_peft_model(tiny_gpt2(), SoftPromptPlusConfig(num_virtual_tokens=3))\n"
        "print(model.base_model.model.config._attn_implementation, *seen())\n"
        "base = model.unload()\n"
        "print(base.config._attn_implementation, base.loss_type)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout.split("\n")
    assert lines[:3] == ["True False False", "softprompt_plus_sdpa True True", "sdpa None"]


USER_MODULE = """import peft_softprompt_plus.tuner
from peft_softprompt_plus.distill import distill_prompt
"""


def test_an_old_path_warns_at_the_user_s_own_line_under_default_filters(tmp_path):
    # Under default filters a DeprecationWarning raised outside __main__ prints nothing (PEP 565): the user's own
    # module, imported by their script, must still see the notice, pointing at its import line.
    (tmp_path / "mymodule.py").write_text(USER_MODULE)
    (tmp_path / "main.py").write_text("import mymodule\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS",)}
    done = subprocess.run([sys.executable, "main.py"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "FutureWarning" in line]
    assert len(lines) == 2, done.stderr
    assert lines[0].startswith(f"{tmp_path / 'mymodule.py'}:1: FutureWarning: `peft_softprompt_plus.tuner` moved")
    assert lines[1].startswith(f"{tmp_path / 'mymodule.py'}:2: FutureWarning: `peft_softprompt_plus.distill.distill")


def test_the_modules_the_cli_checks_arguments_with_import_neither_torch_nor_peft():
    # `softprompt-plus` refuses a bad argument before torch, transformers and PEFT load (the start-up hook lets these
    # modules import without registering). A module that reaches them from here makes every refusal take seconds.
    from peft_softprompt_plus._site.hook import LIGHT

    code = "import sys\n" + "".join(f"import {name}\n" for name in sorted(LIGHT) if not name.endswith("__main__"))
    code += "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_no_two_library_modules_share_a_basename():
    # A file name says which module it is, in a traceback, a log line or a grep, without its folder.
    seen: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_every_upward_import_is_argued_in_architecture_md_and_the_readme_points_there():
    text = (ROOT / "docs" / "architecture.md").read_text()
    exceptions = text[text.index("Imports that reach a lower layer") :]
    exceptions = exceptions[: exceptions.index("\n\n")]
    unargued = sorted({m for m, _ in UPWARD if f"`{m.replace('.', '/')}.py`" not in exceptions})
    assert unargued == []
    readme = (ROOT / "README.md").read_text()
    assert "the few imports [docs/architecture.md](docs/architecture.md) lists with their reasons" in readme

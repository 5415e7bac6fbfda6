"""The package's shape (docs/architecture.md): no import cycles, counting imports inside functions; small modules;
only `_peft_registry.py` changes PEFT; the README's layout lists every module."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "peft_softprompt_plus"
MAX_LINES = 300


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


def test_no_module_over_300_lines():
    sizes = {path.name: len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_only_the_registry_changes_peft():
    # Assigning to a PEFT attribute or registering a method happens in one visible place.
    pattern = re.compile(r"setattr\(\s*(peft|PeftModel|patch\.owner)|register_peft_method|_extend_str_enum\(PeftType")
    writers = {p.name for p in PACKAGE.rglob("*.py") if pattern.search(p.read_text())}
    assert writers == {"_peft_registry.py"}


def test_readme_layout_lists_every_module():
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout") :]
    missing = [p.name for p in PACKAGE.glob("*.py") if f"`{p.name}`" not in layout]
    assert missing == [], f"README's layout misses {missing}"

"""bench/'s shared harness (bench/_stats.py): the intervals every quality report quotes, checked against hand-worked
values, the rule that no bench script writes its own Markdown table or comma-list parser, and no import cycle among
bench/'s modules (a report imports nothing from its script)."""

import ast
import pathlib
import statistics
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import _stats  # noqa: E402


def test_paired_items_make_one_seed_minus_itself_exactly_zero():
    runs = [[1, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    difference = lambda a, b: _stats.mean_of_runs(a) - _stats.mean_of_runs(b)  # noqa: E731
    assert _stats.bootstrap(difference, runs, runs) != (0.0, 0.0, 0.0)  # seeds are drawn per arm
    one = [[1, 0, 1, 1, 0]]
    assert _stats.bootstrap(difference, one, one) == (0.0, 0.0, 0.0)  # paired items: the same picks for both


def test_the_bootstrap_interval_holds_the_point_and_narrows_with_more_items():
    few = [[i % 2 for i in range(20)]]
    many = [[i % 2 for i in range(2000)]]
    point, low, high = _stats.bootstrap(_stats.mean_of_runs, few)
    assert point == 0.5 and low < 0.5 < high
    _, low_many, high_many = _stats.bootstrap(_stats.mean_of_runs, many, draws=400)
    assert high_many - low_many < (high - low) / 5


def test_a_statistic_that_is_nan_in_some_draws_is_dropped_from_the_interval():
    ratio = lambda runs: _stats.mean_of_runs(runs) or float("nan")  # noqa: E731
    point, low, high = _stats.bootstrap(ratio, [[0, 0, 1]], paired=False)
    assert point == pytest.approx(1 / 3) and low == low and high <= 1


def test_the_t_interval_is_the_hand_worked_one():
    values = [0.6, 0.7, 0.8]
    mean, low, high = _stats.t_interval(values)
    half = 4.30 * statistics.stdev(values) / 3**0.5
    assert (mean, low, high) == pytest.approx((0.7, 0.7 - half, 0.7 + half))
    assert _stats.t_interval([0.4]) == (0.4, 0.4, 0.4)


def test_comma_lists_and_markdown():
    assert _stats.comma_list("0, 1,,2") == [0, 1, 2]
    assert _stats.comma_list("3e-3,1e-2", float) == [3e-3, 1e-2]
    assert _stats.markdown(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |"
    assert _stats.spread([0.5, None, 0.25, 0.75]) == "50.0 (25.0–75.0, n=3)"


def test_a_row_is_judged_against_its_target_and_context_rows_are_not():
    assert _stats.Row("ratio", 2.0, target=">= 2.0").verdict == "PASS"
    assert _stats.Row("ratio", 1.99, target=">= 2.0").verdict == "MISS"
    assert _stats.Row("ratio", 1.3, target="<= 1.25").verdict == "MISS"
    assert _stats.Row("context", 9.0).verdict == ""


def test_no_bench_script_writes_its_own_table_rule_or_comma_list_parser():
    found = {}
    for path in BENCH.rglob("*.py"):
        if path.name == "_stats.py":
            continue
        text = path.read_text()
        hits = [marker for marker in ("|---", "---|", '.split(",")') if marker in text]
        if hits:
            found[path.name] = hits
    assert found == {}, "use bench/_stats.py (markdown, markdown_header, comma_list)"


def _bench_imports(path: pathlib.Path, names: set[str]) -> set[str]:
    """The bench modules `path` imports anywhere in its body, functions and `__import__("...")` calls included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__" and node.args:
            found.add(getattr(node.args[0], "value", None))
    return (found & names) - {path.stem}


def test_no_import_cycle_among_bench_modules():
    paths = {path.stem: path for path in BENCH.rglob("*.py")}
    graph = {name: _bench_imports(path, set(paths)) for name, path in paths.items()}
    assert graph["_stats"] == set()  # standard library only
    reports = {name: deps for name, deps in graph.items() if name.endswith("_report")}
    assert reports and {name: [d for d in deps if not d.startswith("_")] for name, deps in reports.items()} == {
        name: [] for name in reports
    }, "a report imports no script: the script passes it what it needs"
    reach = {name: set(deps) for name, deps in graph.items()}
    for _ in paths:  # the transitive closure, one hop per pass
        reach = {name: deps.union(*(reach[d] for d in deps)) for name, deps in reach.items()}
    assert sorted(name for name, deps in reach.items() if name in deps) == [], "bench import cycles"

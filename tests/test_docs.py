"""Docs that run: every Python and shell block in README.md and docs/*.md runs here, page by page in one namespace
(a page reads top to bottom, like a session), or carries a visible marker saying why it can't run in this suite.

The line right above a block may say:
- `*Not run by the tests: <reason>.*`: it needs something this suite doesn't have (vLLM, SGLang, the real Hub, a
  GPU, processes of a distributed job, minutes of training on the real checkpoint); the reason is shown to readers;
- `*Signature, checked against the code.*`: every call in it names the real function's parameters, in order,
  with the defaults it shows.

Blocks run offline in a scratch folder that holds a tiny GPT-2 with its tokenizer under the names the docs use for
a base checkpoint (`gpt2`, `my-base`); `SETUP` gives each page the objects its prose says the reader already has
(`gpt2`, `ids`, `mask`, `model`, ...).
"""

from __future__ import annotations

import ast
import inspect
import os
import pathlib
import re
import warnings
from dataclasses import dataclass

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
NOT_RUN = re.compile(r"^\*Not run by the tests: (.+)\.\*$")
SIGNATURE = "*Signature, checked against the code.*"
RUNNABLE = {"python", "bash"}


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    marker: str  # "" (runs), "not run: <reason>", or "signature"

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: pathlib.Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        lang, code = match.groups()
        if lang not in RUNNABLE:
            continue
        above = text[: match.start()].rstrip("\n").splitlines()
        last = above[-1].strip() if above else ""
        not_run = NOT_RUN.match(last)
        marker = f"not run: {not_run[1]}" if not_run else "signature" if last == SIGNATURE else ""
        line = text[: match.start()].count("\n") + 2  # the block's first line of code
        found.append(Block(str(page.relative_to(ROOT)), line, lang, code, marker))
    return found


ALL = [b for page in PAGES for b in blocks(page)]


# ------------------------------------------------------------------------------------------------ the reader's objects


def _tiny_batch(tokenizer) -> dict:
    tokenizer.padding_side = "left"
    return tokenizer(["the cat sat on the mat", "a dog", "red blue", "the bird"], return_tensors="pt", padding=True)


def _base_names(ns: dict) -> None:
    """What the README's and many pages' prose take as given: a GPT-2 (`gpt2`, `gpt2_again`, `base`), a tokenizer
    and a left-padded batch of 4 rows (`ids`, `mask`, `labels`, `batch`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained("gpt2")
    encoded = _tiny_batch(tokenizer)
    ns.update(
        gpt2=AutoModelForCausalLM.from_pretrained("gpt2"),
        gpt2_again=AutoModelForCausalLM.from_pretrained("gpt2"),
        base=AutoModelForCausalLM.from_pretrained("gpt2"),
        tokenizer=tokenizer,
        ids=encoded["input_ids"],
        mask=encoded["attention_mask"],
        labels=encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100),
        batch={**encoded, "labels": encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100)},
    )


def _peft_model(ns: dict) -> None:
    from peft import get_peft_model

    from peft_softprompt_plus import SoftPromptPlusConfig

    _base_names(ns)
    ns["model"] = get_peft_model(ns.pop("base"), SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    ns["optimizer"] = torch.optim.AdamW([p for p in ns["model"].parameters() if p.requires_grad], lr=3e-2)


def _trainer_data(ns: dict) -> None:
    from transformers import TrainingArguments

    _peft_model(ns)
    rows = [{"input_ids": ids, "labels": ids} for ids in ns["tokenizer"](["the cat sat", "a dog ran"])["input_ids"]]
    from datasets import Dataset

    ns.update(train=rows, val=rows, data=rows, args=TrainingArguments(output_dir="out", max_steps=2, report_to=[]))
    ns["dataset"] = Dataset.from_dict({"text": ["the cat sat on the mat", "a dog ran"]})


def _three_adapters(ns: dict) -> None:
    from peft import get_peft_model

    from peft_softprompt_plus import SoftPromptPlusConfig

    _base_names(ns)
    from transformers import AutoModelForCausalLM

    for seed, name in enumerate(["summarize", "translate", "classify"]):
        torch.manual_seed(seed)
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained("gpt2"), SoftPromptPlusConfig(num_virtual_tokens=4))
        peft.save_pretrained(f"adapters/{name}")


def _saved_prompt(ns: dict) -> None:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from peft_softprompt_plus import SoftPromptPlusConfig

    base = AutoModelForCausalLM.from_pretrained("my-base")
    get_peft_model(base, SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)).save_pretrained(
        "my-prompt"
    )


def _chat_model(ns: dict) -> None:
    _peft_model(ns)
    ns["tokenizer"].chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )


SETUP = {  # page -> what its prose says the reader already has
    "README.md": _base_names,
    "docs/api.md": _chat_model,
    "docs/gradient-flow.md": _trainer_data,
    "docs/integrations.md": _trainer_data,
    "docs/many-tasks.md": _three_adapters,
    "docs/serving.md": _saved_prompt,
}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A folder holding a tiny GPT-2 + tokenizer as `gpt2` and `my-base`, the names the docs load."""
    from peft_softprompt_plus.apps.tiny import save_tiny

    folder = tmp_path_factory.mktemp("docs")
    for name in ("gpt2", "my-base"):
        save_tiny(str(folder / name))
    return folder


# ------------------------------------------------------------------------------------------------------------- tests


def test_every_block_runs_or_says_why_not():
    unmarked_shell = [b.where for b in ALL if b.lang == "bash" and not b.marker]
    assert unmarked_shell == [], "a shell block runs here only through a test that names it; mark it or add one"
    assert len([b for b in ALL if not b.marker]) >= 12  # the pages' own examples, not only markers


def test_the_readme_holds_exactly_two_set_up_commands_and_ci_runs_the_second():
    readme = [b for b in ALL if b.page == "README.md" and b.lang == "bash"]
    assert [b.code.strip().split(" && ")[-1] for b in readme] == [
        "softprompt-plus demo",
        'python -m pytest -q -m "slow or not slow" -n 2 --dist loadgroup',
    ]
    assert "README.md" in (ROOT / ".ci" / "run").read_text()  # .ci/run takes its command from the README


def _signatures(code: str):
    """`(name, ast.arguments)` for each `[targets =] name(parameters) [-> result]` in a signature block."""
    code = "\n".join(line.split("#", 1)[0] for line in code.splitlines() if not line.startswith(("from ", "import ")))
    for match in re.finditer(r"^(?:[\w, ]+=\s*)?(\w+)\(", code, re.M):
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(code)):
            depth += {"(": 1, ")": -1}.get(code[end], 0)
            if depth == 0:
                break
        definition = ast.parse(f"def {match[1]}{code[match.end() - 1 : end + 1]}: pass").body[0]
        yield match[1], definition.args


def _public(name: str):
    import peft_softprompt_plus
    from peft_softprompt_plus.files import hub, inspect_adapter

    for module in (peft_softprompt_plus, hub, inspect_adapter):
        if hasattr(module, name):
            return getattr(module, name)
    raise AssertionError(f"{name} is not a public name")


@pytest.mark.parametrize("block", [b for b in ALL if b.marker == "signature"], ids=lambda b: b.where)
def test_a_documented_signature_is_the_code_s(block):
    found = list(_signatures(block.code))
    assert found, f"{block.where}: no signature found"
    for name, args in found:
        real = [p for p in inspect.signature(_public(name)).parameters.values() if p.name != "self"]
        positional = [a.arg for a in args.posonlyargs + args.args]
        keyword_only = [a.arg for a in args.kwonlyargs]
        kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        assert positional == [p.name for p in real if p.kind not in kinds], f"{block.where}: {name}'s parameters"
        var = [p.name for p in real if p.kind == inspect.Parameter.VAR_KEYWORD]
        assert ([args.kwarg.arg] if args.kwarg else []) == var, f"{block.where}: {name}'s **keywords"
        only = [p.name for p in real if p.kind == inspect.Parameter.KEYWORD_ONLY]
        assert keyword_only == only, f"{block.where}: {name}'s keyword-only ones"
        shown = dict(zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True))
        shown.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None})
        defaults = {p.name: p.default for p in real if p.default is not inspect.Parameter.empty}
        assert {k: ast.literal_eval(v) for k, v in shown.items()} == defaults, f"{block.where}: {name}'s defaults"


RUN_PAGES = sorted({b.page for b in ALL if b.lang == "python" and not b.marker})


@pytest.mark.parametrize("page", RUN_PAGES)
def test_a_page_s_python_blocks_run_in_order(page, scratch, monkeypatch):
    monkeypatch.chdir(scratch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace: dict = {"__name__": "__docs__"}
    SETUP.get(page, lambda ns: None)(namespace)
    for block in (b for b in ALL if b.page == page and b.lang == "python" and not b.marker):
        code = compile(block.code, block.where, "exec")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # third-party import noise; ours is tested apart
            try:
                exec(code, namespace)
            except Exception as err:  # noqa: BLE001 - name the block that failed
                raise AssertionError(f"{block.where} failed: {type(err).__name__}: {err}") from err


def test_setup_is_given_only_to_pages_whose_blocks_run():
    assert set(SETUP) <= set(RUN_PAGES)


def test_every_test_file_the_docs_name_exists():
    named = {
        m for page in [*PAGES, ROOT / "bench" / "README.md"] for m in re.findall(r"tests/[\w/]+\.py", page.read_text())
    }
    named.discard("tests/test_decoder_models.py")  # PEFT's own test file, which tests/run_peft_generic.py runs
    assert named and sorted(n for n in named if not (ROOT / n).exists()) == []


def test_the_cli_table_lists_every_flag_and_default_of_every_subcommand():
    """api.md's command-line table against the parsers: each subcommand's row names exactly its flags, and a default
    written in the row (`[--flag VALUE]`) is the parser's."""
    import argparse

    from peft_softprompt_plus.apps.cli import build_parser
    from peft_softprompt_plus.apps.flags import RENAMED  # 0.2.0 spellings: named in api.md's prose, not its rows

    text = (ROOT / "docs" / "api.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `softprompt-plus (\w+)([^`]*)` \|", text, re.M)}
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert sorted(rows) == sorted(subparsers), "api.md's table and the CLI's subcommands differ"
    for name, row in rows.items():
        actions = [a for a in subparsers[name]._actions if a.option_strings and "--help" not in a.option_strings]
        flags = {s for a in actions for s in a.option_strings if s.startswith("--") and s not in RENAMED}
        written = set(re.findall(r"(--[a-z][a-z0-9-]*)", row))
        assert written == flags, (
            f"softprompt-plus {name}: api.md has {sorted(written - flags)} extra, lacks {sorted(flags - written)}"
        )
        for action in actions:
            shown = re.search(rf"\[{re.escape(action.option_strings[-1])} ([^\]\s|.]+)\]", row)
            if shown and shown.group(1).replace("_", "").replace(".", "").isalnum() and not shown.group(1).isupper():
                assert str(action.default) == shown.group(1) or _same_number(action.default, shown.group(1)), (
                    f"softprompt-plus {name} {action.option_strings[-1]}: api.md shows {shown.group(1)!r}, the "
                    f"parser's default is {action.default!r}"
                )


def _same_number(default, shown: str) -> bool:
    try:
        return float(default) == float(shown)
    except (TypeError, ValueError):
        return False


def test_serving_md_s_flag_table_is_the_serve_parser_s():
    """docs/serving.md's "Exposing it" table: each flag exists, and a number in its default column is the default."""
    import argparse

    from peft_softprompt_plus.apps.cli import build_parser

    text = (ROOT / "docs" / "serving.md").read_text()
    rows = re.findall(r"^\| `(--[a-z-]+)[^`]*` \| ([^|]+) \|", text, re.M)
    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    defaults = {s: a.default for a in serve._actions for s in a.option_strings}
    assert len(rows) >= 8 and all(flag in defaults for flag, _ in rows), rows
    for flag, shown in rows:
        if shown.strip().isdigit():
            assert int(shown) == defaults[flag], (
                f"serving.md shows {flag} {shown.strip()}, the parser {defaults[flag]}"
            )


def _field_table(page: str, heading: str) -> dict[str, tuple[str, str]]:
    """`| `name` | `type` | `default` | ... |` rows under `heading` in `page`: name -> (type, default) as written."""
    text = (ROOT / page).read_text()
    section = text[text.index(heading) :]
    rows = {}
    for line in section.splitlines()[1:]:
        if line.startswith("#") or (rows and not line.startswith("|")):
            break  # the next section, or the end of the first table
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) >= 3 and cells[0].startswith("`") and cells[2].startswith("`"):
            for name in cells[0].split(", "):  # one row may describe a pair of fields
                rows[name.strip("`")] = (cells[1].strip("`"), cells[2].strip("`"))
    return rows


def test_the_config_table_lists_every_field_of_its_own_with_the_code_s_default():
    import dataclasses
    import enum

    from peft import PeftConfig

    from peft_softprompt_plus import SoftPromptPlusConfig

    inherited = {f.name for f in dataclasses.fields(PeftConfig)}
    fields = {f.name: f for f in dataclasses.fields(SoftPromptPlusConfig)}
    table = _field_table("docs/api.md", "### `SoftPromptPlusConfig`")
    assert sorted(set(fields) - inherited - set(table)) == []  # every field of its own is listed
    assert sorted(set(table) - set(fields)) == []  # and nothing that is not a field (PEFT's own may be)
    for name in table:
        default = fields[name].default
        shown = repr(default.value if isinstance(default, enum.Enum) else default).replace("'", '"')
        assert table[name][1] == shown, f"api.md says {name} defaults to {table[name][1]}, the code {shown}"


def test_the_kernel_list_in_concepts_md_is_every_name_last_kernels_can_hold():
    import re

    source = "".join(p.read_text() for p in (ROOT / "src" / "peft_softprompt_plus" / "forward").glob("*.py"))
    named = set(re.findall(r'kernels\.add\("(\w+)"\)', source)) | set(re.findall(r'frozenset\(\{"(\w+)"\}\)', source))
    masked = re.findall(r'^\s+"(\w+)": \(_masked_function\("\1"', source, re.M)  # f"{kernel_name}_mask" for each
    assert masked and "{kernel_name}_mask" in source
    names = named | {f"{k}_mask" for k in masked}
    text = (ROOT / "docs" / "concepts.md").read_text()
    bullet = text[text.index("**Which kernel runs when**") :].split("\n- ")[0]
    shown = set(re.findall(r"`((?:sdpa|eager|flash|concat)\w*)`", bullet))
    shown = {n for n in shown if not n.startswith("flash_attention_")}  # attn_implementation names, not kernels
    assert names == shown, f"code only: {sorted(names - shown)}; concepts.md only: {sorted(shown - names)}"


def test_bench_readme_lists_every_script_and_the_docs_that_quote_it():
    import re

    text = (ROOT / "bench" / "README.md").read_text()
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `(\w+\.py)` \|.*\| ([^|]+) \|$", text, re.M)}
    scripts = {p.name for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_")}
    assert sorted(rows) == sorted(scripts), "bench/README.md's table and bench/'s scripts differ"
    pages = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    for script, cell in rows.items():
        quoting = {p.name for p in pages if script in p.read_text()}
        assert set(re.findall(r"\[([\w.-]+\.md)\]", cell)) - {"RESULTS.md"} == quoting, f"{script}: {cell}"


def test_every_bench_script_reruns_a_results_section_its_readme_row_names():
    text = (ROOT / "bench" / "README.md").read_text()
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `(\w+\.py)` \|(.*)\|$", text, re.M)}
    scripts = {p.name for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_")}
    assert sorted(rows) == sorted(scripts), "bench/README.md's table and bench/'s scripts differ"
    results = FENCE.sub("", (ROOT / "bench" / "RESULTS.md").read_text())
    headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", results, re.M)}
    sections = {script: re.findall(r"\]\(RESULTS\.md#([\w-]+)\)", row) for script, row in rows.items()}
    assert [script for script, anchors in sections.items() if not anchors] == [], "a script that reruns no section"
    assert {script: sorted(set(anchors) - headings) for script, anchors in sections.items()} == {s: [] for s in rows}


def test_bench_readme_states_the_kv_sink_default_of_the_code():
    from peft_softprompt_plus import SoftPromptPlusConfig

    default = SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, prompt_level="kv").kv_frozen_positions
    text = (ROOT / "bench" / "README.md").read_text()
    assert f"`kv_frozen_positions={default}`, the default" in text


def test_the_distillation_defaults_the_docs_state_are_the_code_s():
    from peft_softprompt_plus.distill.refusals import LEVEL_DEFAULTS
    from peft_softprompt_plus.distill.train import SELECTION_ROWS

    kv, text = LEVEL_DEFAULTS["kv"], (ROOT / "docs" / "distillation.md").read_text()
    recipe = text[text.index("**The KV student's recipe**") :].split("\n\n")[0]
    assert f"lr {kv['lr']:.0e}".replace("e-0", "e-") in recipe and f"the `{kv['prompt_init']}` start" in recipe
    assert ("self-study" in recipe) == kv["self_study"]
    assert f"(`kv_frozen_positions` {kv['kv_frozen_positions']})" in recipe
    assert f"N = {kv['num_virtual_tokens']} selected positions (plus the kept ones" in recipe
    assert f"reply positions of {SELECTION_ROWS} rows" in text
    api = (ROOT / "docs" / "api.md").read_text()
    start = api.index("`lr`, `prompt_init`, `self_study` and `kv_frozen_positions` left None")
    line = " ".join(api[start:].split("\n")[:3])
    n = api[api.index("- `num_virtual_tokens` left None is") :][:200]
    assert f"is {LEVEL_DEFAULTS['input']['num_virtual_tokens']} for an input" in n
    assert f"for a KV one, {LEVEL_DEFAULTS['kv']['num_virtual_tokens']} selected" in n
    for level, d in LEVEL_DEFAULTS.items():
        assert f"{d['lr']:.0e}".replace("e-0", "e-") in line and f'`"{d["prompt_init"]}"`' in line, level


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_every_relative_link_and_anchor_in_the_docs_resolves():
    pages = [*PAGES, ROOT / "bench" / "README.md", ROOT / "bench" / "RESULTS.md", ROOT / "CHANGELOG.md"]
    pages += sorted((ROOT / "examples").glob("*.md"))
    broken = []
    for page in (p for p in pages if p.exists()):
        text = FENCE.sub("", page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", FENCE.sub("", file.read_text()), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


# ------------------------------------------------------------------------------ figures quoted from bench/RESULTS.md


def _results_section(heading: str) -> str:
    """bench/RESULTS.md from the heading that starts with `heading` to the next heading of its level or above."""
    text = (ROOT / "bench" / "RESULTS.md").read_text()
    start = text.index(f"\n{heading}") + 1
    body = text.index("\n", start)
    end = re.search(r"^#{1,%d} " % len(heading.split(" ")[0]), text[body:], re.M)
    return text[start : body + end.start()] if end else text[start:]


def _md_table(text: str, header_start: str) -> list[dict[str, str]]:
    """The rows of the first table in `text` whose header line starts with `header_start`, as header -> cell."""
    lines = text[text.index(header_start) :].splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True)))
    return rows


SUITE_KV = "## Task suite: KV arms against PEFT's prefix methods"
SUITE_KV_ANCHOR = "task-suite-kv-arms-against-pefts-prefix-methods-bench_suitepy-2026-12-06"


def test_the_kv_step_saving_training_recipe_md_quotes_is_the_suite_s_cpu_table():
    """The KV prompt's step against the input prompt's, as the suite's KV section's CPU-seconds table gives it."""
    rows = _md_table(_results_section(SUITE_KV), "| task | ours-vocab | ours-kv-vocab |")
    kv = [float(r["ours-kv-text-nosink"]) for r in rows]
    vocab = [float(r["ours-vocab"]) for r in rows]
    saved = [round(100 * (1 - k / v)) for k, v in zip(kv, vocab, strict=True)]
    text = " ".join((ROOT / "docs" / "training-recipe.md").read_text().split())
    quoted = f"step {min(saved)}–{max(saved)}% cheaper (no prompt pass: " + ", ".join(f"{k:.2f}" for k in kv[:-1])
    assert quoted + f" and {kv[-1]:.2f} CPU s against " in text, saved
    assert ", ".join(f"{v:.2f}" for v in vocab[:-1]) + f" and {vocab[-1]:.2f}" in text
    assert f"RESULTS.md#{SUITE_KV_ANCHOR}" in text and "up to 30%" not in text


def test_distillation_md_quotes_the_suite_s_sink_differences_with_their_intervals():
    rows = _md_table(_results_section(SUITE_KV), "| task | KV (every position) - hard 3-shot |")
    cells = [r["KV every position - KV sink frozen"] for r in rows]
    found = [re.match(r"([+-][\d.]+) \[([+-][\d.]+), ([+-][\d.]+)\]", c).groups() for c in cells]
    text = " ".join((ROOT / "docs" / "distillation.md").read_text().split())
    assert f"{found[0][0]}, {found[1][0]} and {found[2][0]} points against freezing it" in text, found
    assert "each 95% interval across zero" in text
    assert all(float(low) < 0 < float(high) for _, low, high in found), found
    assert "~3 points" not in text


def test_the_ferry_prose_in_results_md_quotes_its_own_table():
    section = _results_section("### KV students on a prompt written after the recipe was fixed")
    rows = {r["arm"]: r for r in _md_table(section, "| arm | seeds |")}
    kept = next(r for arm, r in rows.items() if "facts kept as hard text" in arm)
    kv = rows["KV, selected start, 3 turns per part, answer weight 0.5, N=32 (untrained)"]
    trained = next(r for arm, r in rows.items() if arm.startswith("KV, selected start") and "60 steps" in arm)
    prose = " ".join(section[section.index("- **Targets") :].split("\n- ")[0].split())
    first = lambda cell: cell.split(" [")[0]  # noqa: E731 - the mean, before its interval
    assert f"({first(kv['KL gap closed'])} untrained, {first(trained['KL gap closed'])} trained" in prose
    assert f"closes {first(kept['KL gap closed'])} and keeps {first(kept['content kept'])}" in prose
    alone_gap, alone_content = kept["kept text alone: gap / content"].split(" / ")
    assert f"the kept text alone closes {alone_gap} and keeps {alone_content}" in prose


def test_training_recipe_md_serves_a_kv_prompt_through_the_front():
    """The form table's serving row: a KV prompt is served by `softprompt-plus serve --kv-share` and the connector."""
    import argparse
    import importlib.util

    from peft_softprompt_plus.apps.cli import build_parser
    from peft_softprompt_plus.serve import kv_fields as serve_kv

    text = (ROOT / "docs" / "training-recipe.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| serving |"))
    kv_cell = row.strip("|").split("|")[2]
    assert "`softprompt-plus serve --kv-share DIR`" in kv_cell and "KV connector" in kv_cell
    assert "(serving.md#kv-prompts-through-vllms-kv-connector)" in kv_cell
    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    assert "--kv-share" in {s for a in serve._actions for s in a.option_strings}
    assert importlib.util.find_spec(serve_kv.CONNECTOR_MODULE) is not None


def test_serving_md_says_which_errors_name_server_paths(scratch):
    """A `PUT`'s refusals echo the folder and the adapter's `base_model_name_or_path`, as serving.md says."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from peft_softprompt_plus import SoftPromptPlusConfig
    from peft_softprompt_plus.serve.front import Front
    from peft_softprompt_plus.serve.requests import FrontError

    text = " ".join((ROOT / "docs" / "serving.md").read_text().split())
    assert "A Completions or Chat request's errors name no server path or address." in text
    assert "a refused `PUT` echoes the folder it was sent" in text and "`base_model_name_or_path` as saved" in text
    other = str(scratch / "gpt2")  # trained on the `gpt2` folder, served on `my-base`
    folder = str(scratch / "put-elsewhere")
    get_peft_model(
        AutoModelForCausalLM.from_pretrained(other), SoftPromptPlusConfig(num_virtual_tokens=2)
    ).save_pretrained(folder)
    with pytest.raises(FrontError, match="was trained on") as refused:
        Front(str(scratch / "my-base")).add("x", folder)
    assert folder in str(refused.value) and repr(other) in str(refused.value)


# ---------------------------------------------------------------------------------------- examples/serve_with_vllm.md


def _commands(page: pathlib.Path) -> list[list[str]]:
    """Each shell command of `page`'s bash blocks as its words, continuation lines joined, `NAME=value` prefixes and
    `$(...)` assignments dropped (`BASE=$(softprompt-plus fetch smollm2)` is the command inside), `$HOME` expanded as
    the shell does."""
    import shlex

    found = []
    for block in (b for b in blocks(page) if b.lang == "bash"):
        for line in block.code.replace("\\\n", " ").splitlines():
            for command in line.split(" && "):
                inner = re.match(r"^\w+=\$\((.*)\)$", command.strip())
                words = [
                    os.path.expandvars(w) if "$HOME" in w else w for w in shlex.split(inner[1] if inner else command)
                ]
                while words and re.match(r"^[A-Z_]+=", words[0]):
                    words = words[1:]
                if words:
                    found.append(words)
    return found


def _options(words: list[str]) -> dict[str, list[str]]:
    """`--flag value` pairs (a flag without a value maps to []), repeated flags gathered."""
    found: dict[str, list[str]] = {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            value = words[i + 1 : i + 2]
            found.setdefault(word, []).extend(v for v in value if not v.startswith("--"))
    return found


SERVING_PAGES = ["serve_with_vllm.md", "serve_distilled_and_composed.md", "serve_at_tp2.md"]


@pytest.mark.parametrize("name", SERVING_PAGES)
def test_the_serving_examples_name_real_flags_files_and_names(name):
    """Each walkthrough's commands against the parsers they reach: the front's, the distill command's, the example
    scripts' own; the vLLM command against the flags the front needs and the connector's config for the same share;
    the client against the names the front serves."""
    import argparse
    import importlib.util
    import json
    import runpy

    from peft_softprompt_plus.apps.cli import build_parser
    from peft_softprompt_plus.apps.fetch import CHECKPOINTS
    from peft_softprompt_plus.serve import kv_fields as serve_kv
    from peft_softprompt_plus.serve.upstream import UPSTREAM_FLAGS

    page = ROOT / "examples" / name
    commands = _commands(page)
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    flags_of = lambda parser: {s for a in parser._actions for s in a.option_strings}  # noqa: E731
    saved, front, vllm = set(), None, None
    for words in commands:
        if words[:2] == ["softprompt-plus", "fetch"]:
            assert words[2] in CHECKPOINTS, words
        elif words[:2] == ["softprompt-plus", "distill"]:
            assert set(_options(words)) <= flags_of(sub["distill"]), sorted(
                set(_options(words)) - flags_of(sub["distill"])
            )
            sub["distill"].parse_args(words[2:])  # every value of the right type
            assert all((ROOT / f).is_file() for f in _options(words).get("--system-prompt-file", []))
            saved.add(_options(words)["--output-dir"][0])  # the adapter folder itself
        elif words[:2] == ["softprompt-plus", "serve"]:
            front = _options(words)
            assert set(front) <= flags_of(sub["serve"]), sorted(set(front) - flags_of(sub["serve"]))
        elif words[:1] == ["python"] and words[1].startswith("examples/"):
            script = ROOT / words[1]
            assert script.exists(), words[1]
            example = runpy.run_path(str(script), run_name="checked")  # its definitions, not its main
            example["parse_args"](words[2:])  # every flag and value the page passes, by the script's own parser
            assert all(f'"{flag}"' in script.read_text() for flag in _options(words)), words  # not abbreviated
            saved.add(_options(words)["--output-dir"][0] + "/adapter")  # where each example saves its adapter
        elif words[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]:
            vllm = _options(words)
    assert front is not None and vllm is not None and saved
    adapters = dict(a.split("=", 1) for a in front["--adapter"])
    assert sorted(adapters.values()) == sorted(saved)  # the front serves the folders the commands wrote
    composed = dict(c.split("=", 1) for c in front.get("--compose", []))
    assert all(set(parts.split(",")) <= set(adapters) for parts in composed.values()), composed
    assert all(f in vllm for f in UPSTREAM_FLAGS.split(" ") if f.startswith("--"))
    assert vllm["--dtype"] == [UPSTREAM_FLAGS.split("--dtype ")[1].split()[0]]
    share = front["--kv-share"][0]
    assert json.loads(vllm["--kv-transfer-config"][0]) == json.loads(serve_kv.vllm_config(share))
    assert importlib.util.find_spec(serve_kv.CONNECTOR_MODULE) is not None
    assert front["--upstream"] == [f"http://127.0.0.1:{vllm['--port'][0]}"]
    assert front["--base"] == vllm["--model"]  # the front reads the checkpoint vLLM serves
    client = next(b.code for b in blocks(page) if b.lang == "python")
    assert f'base_url="http://127.0.0.1:{front["--port"][0]}/v1"' in client
    named = {
        n for n in re.findall(r"for name in \(([^)]*)\)", client)[0].replace('"', "").replace(" ", "").split(",") if n
    }
    assert named and named <= set(adapters) | set(composed), (named, adapters, composed)


def test_the_tp2_page_s_engine_is_the_one_the_vllm_check_runs():
    """bench/vllm_check.py --parts tp reads its TP=2 engine's parallel flags and thread binding from this page."""
    import sys

    sys.path.insert(0, str(ROOT / "bench" / "vllm"))
    try:
        import _vllm_tp
    finally:
        sys.path.pop(0)
    text = (ROOT / "examples" / "serve_at_tp2.md").read_text()
    flags, bind = _vllm_tp.LAYOUTS["tp2"]
    assert flags == ["--tensor-parallel-size", "2"] and bind == "0|1"
    assert f'VLLM_CPU_OMP_THREADS_BIND="{bind}"' in text and " ".join(flags) in text


def test_distillation_md_says_the_front_folds_a_selected_kv_student_on_rotary_bases_only():
    """A `selected` KV student's text starts where the system turn ended (tests/test_examples.py reads it off the
    distill example); the front folds a KV adapter whose text starts past N on a rotary base and refuses it, with the
    fold's reason, on GPT-2 (tests/serve/test_fit.py serves a folded one)."""
    from peft_softprompt_plus.apps.tiny import tiny_family
    from peft_softprompt_plus.serve.fit import check_foldable
    from peft_softprompt_plus.serve.requests import FrontError

    text = " ".join((ROOT / "docs" / "distillation.md").read_text().split())
    assert "serves only a KV prompt whose text starts at N" in text
    assert "`softprompt-plus serve` folds such a student at load on a rotary base" in text
    assert "refuses it, with the fold's reason, on others (GPT-2's absolute positions)" in text
    late = {"num_virtual_tokens": 4, "kv_text_start": 9}
    check_foldable("kv", "folder", late, tiny_family("llama").config)
    check_foldable("kv", "folder", {"num_virtual_tokens": 4, "kv_text_start": 4}, tiny_family("gpt2").config)
    with pytest.raises(FrontError, match="kv_text_start=9, not N=4.*learned absolute position embeddings"):
        check_foldable("kv", "folder", late, tiny_family("gpt2").config)


def test_bench_readme_names_every_vllm_check_part():
    """bench/README.md's `vllm_check.py` row names each part `vllm_check.py --parts` takes."""
    tree = ast.parse((ROOT / "bench" / "vllm_check.py").read_text())
    parts = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "PARTS"
    )
    row = next(
        line for line in (ROOT / "bench" / "README.md").read_text().splitlines() if "| `vllm_check.py` |" in line
    )
    assert len(parts) >= 10 and [p for p in parts if f"`{p}`" not in row] == []


def test_serving_md_states_the_connector_s_cache_bound_and_the_share_folder_s_mode():
    from peft_softprompt_plus.integrations.kv_connector_core import DEFAULT_CACHE_BYTES
    from peft_softprompt_plus.serve.salts import SALT_HEX
    from peft_softprompt_plus.serve.share import FOLDER_MODE

    text = " ".join((ROOT / "docs" / "serving.md").read_text().split())
    assert DEFAULT_CACHE_BYTES == 1 << 30 and "(1 GiB by default, `DEFAULT_CACHE_BYTES`)" in text
    assert f"with mode {FOLDER_MODE:o}" in text.replace("mode 0750", "mode 750")
    assert f"{SALT_HEX} hex digits of an HMAC-SHA-256" in text


# Claims in prose, each read against the code it describes.


def test_the_changelog_counts_the_distill_options_the_dataclass_has():
    from dataclasses import fields

    from peft_softprompt_plus.distill.options import DistillOptions

    said = re.findall(r"takes its (\d+) choices in one documented dataclass", (ROOT / "CHANGELOG.md").read_text())
    assert said and all(int(n) == len(fields(DistillOptions)) for n in said), said


def test_every_stated_kv_frozen_positions_default_is_the_one_attach_fills_in():
    from peft_softprompt_plus import SoftPromptPlusConfig

    filled = SoftPromptPlusConfig(prompt_level="kv", num_virtual_tokens=4).kv_frozen_positions
    pages = [ROOT / "CHANGELOG.md", *PAGES]
    said = [
        (page.name, int(n))
        for page in pages
        for n in re.findall(r"`kv_frozen_positions`\s+\(default\s+(\d+)", page.read_text())
    ]
    assert said and all(n == filled for _, n in said), (filled, said)


def test_serving_is_installed_from_the_checkout_not_from_an_index_release_without_kv_share():
    index_installs = re.compile(r"pip install '?peft-softprompt-plus\[[^\]]*serve")
    pages = [*PAGES, *sorted((ROOT / "examples").glob("*.md"))]
    assert [p.name for p in pages if index_installs.search(p.read_text())] == []
    assert "pip install '.[serve]'" in (ROOT / "docs" / "serving.md").read_text()


def test_the_leave_one_out_warning_s_row_count_is_the_code_s():
    from peft_softprompt_plus.forward.state import UNMATCHED_WARNING_ROWS

    pages = {
        "docs/concepts.md": r"when the first (\d+) of them match no demonstration",
        "docs/api.md": r"a run whose first (\d+) such rows match no demonstration",
        "CHANGELOG.md": r"one warning says so when the first (\d+) match",
    }
    for page, said in pages.items():
        text = " ".join((ROOT / page).read_text().split())
        assert [int(n) for n in re.findall(said, text)] == [UNMATCHED_WARNING_ROWS], page

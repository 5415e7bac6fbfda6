"""Run PEFT's own generic decoder-model tests against SOFTPROMPT_PLUS, offline, and compare with the expected table.

PEFT's `tests/test_decoder_models.py` (with `tests/testing_common.py`) runs every PEFT method through the same ~40
checks (save/load, adapter names, delete/disable/unload, generate, training, gradient checkpointing, merging, ...)
on tiny Hub models. This script runs those checks, unchanged, on `SoftPromptPlusConfig`:

1. copies the five files it needs from a PEFT checkout's `tests/` into a scratch folder;
2. appends `(SoftPromptPlusConfig, {"task_type": "CAUSAL_LM", "num_virtual_tokens": 4})` to the
   test module's `ALL_CONFIGS` (on the copy; PEFT's checkout is never written to);
3. builds seeded tiny random models from configs, saved in folders named like the Hub ids the tests use
   (`peft-internal-testing/tiny-random-GPT2LMHeadModel`, ...) under the scratch folder, where pytest runs with
   `HF_HUB_OFFLINE=1`: `from_pretrained(id)` resolves each id to its local folder, and nothing touches the network;
4. writes a `conftest.py` that imports `peft_softprompt_plus`, stubs `diffusers` when it is not installed
   (`testing_common.py` only needs its `StableDiffusionPipeline` name for `isinstance`), makes PEFT's
   `set_init_weights_false` leave our kwargs alone (it adds `init_weights=False` to configs it doesn't know, so
   that they are not an identity transform; a soft prompt never is one and has no such option: PEFT treats its
   own `LNTuningConfig` and `VBLoRAConfig` the same way), deselects every test that is not parametrized with
   our config (or whose model has no local build), and keeps `check_beft_config` from adding GPT-J's LoRA-style
   `target_modules` to our kwargs (its `isinstance(config_cls, BeftConfig)` guard is never true for a class);
5. widens PEFT's LoRA-only gates of `test_mixed_adapter_batches` and `test_generate_with_mixed_adapter_batches` to
   our config, which supports `adapter_names=` (docs/many-tasks.md); `--peft-gates` keeps PEFT's gates (skips);
6. runs pytest, then prints passed/failed/skipped and checks each failure against `EXPECTED_FAILURES` below: the
   documented design differences of this method. The exit status is 0 when the failures are exactly the expected
   ones (a design difference that unexpectedly passes is reported, but is not an error), 1 otherwise.

Command (from a clean environment; PEFT's tests need `datasets`, `accelerate`, `pyyaml`, `scipy`, `pytest`):

    git clone --depth 1 --branch v0.21.2 https://github.com/huggingface/peft /tmp/peft   # or a nearby commit
    # or, from the package index: PEFT's sdist holds tests/ without __init__.py and conftest.py (neither is needed)
    pip download --no-deps --no-binary :all: peft==0.21.2 && tar xzf peft-0.21.2.tar.gz   # then peft-0.21.2/tests
    OMP_NUM_THREADS=1 python tests/run_peft_generic.py --peft-tests /tmp/peft/tests

Options: `--peft-gates` keeps PEFT's own skip of the mixed-batch tests; `--work DIR` keeps the scratch folder
(default: a temporary one, removed afterwards); `--models gpt2,opt` keeps the model ids containing one of those
substrings (case-insensitive); `-k EXPR` and `-x` go to pytest; `--pytest-args "..."` passes anything else.
The file is named `run_*.py` so that the project's own pytest run never collects it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

# The config our parametrization adds to PEFT's ALL_CONFIGS. No `init_seed`: the tests seed torch's generator
# themselves (`torch.manual_seed(1)` before a second adapter, which must then differ from the first).
OUR_CONFIG_KWARGS = {"task_type": "CAUSAL_LM", "num_virtual_tokens": 4}

# The files of PEFT's tests/ that test_decoder_models.py needs.
PEFT_TEST_FILES = ("testing_common.py", "testing_utils.py", "test_decoder_models.py")
# Copied when present; PEFT's sdist leaves them out. The package marker is then written empty, and PEFT's conftest
# (a --regression option, transformers deprecations as errors) is not needed to run the generic tests.
PEFT_OPTIONAL_FILES = ("__init__.py", "conftest.py")

# Failures that follow from documented design decisions (docs/api.md, docs/many-tasks.md, docs/troubleshooting.md).
# Key: the test function's name (expected for every model of the matrix); value: (a regex that the failure's full
# report must match, why). A failure of a listed test whose report doesn't match is reported as unexpected.
_MERGE = (r"cannot be merged", "merging is refused by design: a prompt is an input, not a weight delta (docs/api.md)")
_FLOAT32 = (
    r'assert get_adapter_dtype\(model, "default"\) <= expected_dtype',
    "the prompt is a float32 leaf whatever the base's dtype and `autocast_adapter_dtype`, and is cast only where it "
    "is used, so its gradient and optimizer state stay float32 (docs/precision.md)",
)
EXPECTED_FAILURES: dict[str, tuple[str, str]] = {
    "test_merge_layers": _MERGE,
    "test_merge_layers_multi": _MERGE,
    "test_merge_layers_nan": _MERGE,
    "test_merge_layers_fp16": _MERGE,
    "test_add_adapter_no_autocast_adapter_dtype": _FLOAT32,
    # Only run with the widened gates (the default; see --peft-gates).
    "test_mixed_adapter_batches": (
        r"assert torch\.allclose\(output_base\[::3\], output_mixed\[::3\]",
        "a '__base__' row counts positions from its real tokens, so its padding moves nothing (docs/many-tasks.md); "
        "the test's row [1, 2, 1] with mask [1, 0, 1] differs from the bare base at the pad (OPT) and, on GPT-2, "
        "whose bare forward numbers positions 0..L-1 through pads, also at the real token after it (which then "
        "equals the bare base on the unpadded row [1, 1])",
    ),
    "test_generate_with_mixed_adapter_batches": (
        r"assert not gens_are_same\(gen_base, gen_adapter",
        "the test's precondition, that beam search with an adapter differs from the base, fails on the tiny Llama "
        "stand-in (hidden size 8) even with the prompt x10; its beam-search sequences and scores equal those of the "
        "base model generating from inputs_embeds=[P; embed(x)]",
    ),
}

# PEFT gates the two mixed-adapter-batch tests to LoRA by class; SOFTPROMPT_PLUS supports `adapter_names=` in
# forward and generate (docs/many-tasks.md), so by default the runner widens those gates to our config too.
# (file, the gate as PEFT writes it, the widened gate)
_OURS = "config_cls.__name__ == 'SoftPromptPlusConfig'"
MIXED_BATCH_GATES = (
    (
        "test_decoder_models.py",
        'if config_cls != LoraConfig:\n            pytest.skip("Mixed adapter batches',
        f'if config_cls != LoraConfig and not {_OURS}:\n            pytest.skip("Mixed adapter batches',
    ),
    (
        "testing_common.py",
        "if config_cls not in (LoraConfig, RoadConfig):\n            pytest.skip(",
        f"if config_cls not in (LoraConfig, RoadConfig) and not {_OURS}:\n            pytest.skip(",
    ),
    (
        "testing_common.py",
        "if config_cls not in (LoraConfig,):\n            # note: RoAD supports mixed adapter batches",
        f"if config_cls not in (LoraConfig,) and not {_OURS}:\n"
        "            # note: RoAD supports mixed adapter batches",
    ),
)

# Seeded tiny random models standing in for the Hub ids of PEFT's test matrix, sized like the Hub's tiny models.
# id -> (transformers config class name, config kwargs). A model id of the test module missing here is deselected.
LOCAL_MODELS: dict[str, tuple[str, dict]] = {
    "peft-internal-testing/tiny-random-OPTForCausalLM": (
        "OPTConfig",
        dict(
            vocab_size=1000,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=4,
            word_embed_proj_dim=16,
            max_position_embeddings=100,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
        ),
    ),
    "peft-internal-testing/tiny-random-GPT2LMHeadModel": (
        "GPT2Config",
        dict(vocab_size=1000, n_embd=32, n_layer=5, n_head=4, n_inner=37, n_positions=512, bos_token_id=98),
    ),
    "hf-internal-testing/tiny-random-gpt2": (
        "GPT2Config",
        dict(vocab_size=1000, n_embd=32, n_layer=5, n_head=4, n_inner=37, n_positions=512, bos_token_id=98),
    ),
    "peft-internal-testing/tiny-random-GPTJForCausalLM": (
        "GPTJConfig",
        dict(vocab_size=1000, n_embd=32, n_layer=5, n_head=4, rotary_dim=4, n_positions=512, bos_token_id=98),
    ),
    "trl-internal-testing/tiny-random-LlamaForCausalLM": (
        "LlamaConfig",
        dict(
            vocab_size=1000,
            hidden_size=8,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
        ),
    ),
    "peft-internal-testing/tiny-dummy-qwen2": (
        "Qwen2Config",
        dict(
            vocab_size=1000,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
        ),
    ),
    "hf-internal-testing/tiny-random-Gemma3ForCausalLM": (
        "Gemma3TextConfig",
        dict(
            vocab_size=1000,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=512,
            sliding_window=8,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
        ),
    ),
    "hf-internal-testing/tiny-random-MistralForCausalLM": (
        "MistralConfig",
        dict(
            vocab_size=1000,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
        ),
    ),
}

CONFTEST = '''\
"""Written by run_peft_generic.py: offline setup and selection of the SOFTPROMPT_PLUS parametrizations."""

import json
import os
import sys
import types

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

try:
    import diffusers  # noqa: F401
except ImportError:  # testing_common.py imports StableDiffusionPipeline only for isinstance checks
    _stub = types.ModuleType("diffusers")

    class StableDiffusionPipeline:  # never instantiated
        pass

    _stub.StableDiffusionPipeline = StableDiffusionPipeline
    sys.modules["diffusers"] = _stub

import torch  # noqa: E402

import peft_softprompt_plus  # noqa: E402  (registers SOFTPROMPT_PLUS with PEFT)

torch.set_num_threads(1)

# PEFT's set_init_weights_false() adds `init_weights=False` to every non-prompt-learning config it doesn't list, so
# that the adapter is not an identity transform. A soft prompt never is one and has no such option: return the
# kwargs unchanged, as PEFT does for its own methods without it (LNTuningConfig, VBLoRAConfig).
import tests.testing_utils as _testing_utils  # noqa: E402

_set_init_weights_false = _testing_utils.set_init_weights_false


def _set_init_weights_false_ours(config_cls, kwargs):
    if config_cls is peft_softprompt_plus.SoftPromptPlusConfig:
        return kwargs.copy()
    return _set_init_weights_false(config_cls, kwargs)


_testing_utils.set_init_weights_false = _set_init_weights_false_ours

_MODELS = set(json.loads(os.environ["SPP_GENERIC_MODELS"]))
_RESULTS = os.environ["SPP_GENERIC_RESULTS"]
_reports = {}


def pytest_collection_modifyitems(config, items):
    # test_decoder_models.check_beft_config() means to adjust BEFT's kwargs, but its `isinstance(config_cls, ...)`
    # is never true for a class, so for GPT-J it adds `target_modules=["fc_out"]` to every config. A soft prompt
    # targets no module and refuses that keyword before the merge tests reach the merge: leave our kwargs alone.
    module = sys.modules.get("tests.test_decoder_models")
    if module is not None and hasattr(module, "check_beft_config"):
        check_beft_config = module.check_beft_config

        def check_beft_config_ours(config_cls, model_id, config_kwargs):
            if config_cls is not peft_softprompt_plus.SoftPromptPlusConfig:
                check_beft_config(config_cls, model_id, config_kwargs)

        module.check_beft_config = check_beft_config_ours

    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        ours = params.get("config_cls") is peft_softprompt_plus.SoftPromptPlusConfig
        model_ok = "model_id" not in params or params["model_id"] in _MODELS
        (keep if ours and model_ok else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_runtest_logreport(report):
    entry = _reports.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        crash = getattr(report.longrepr, "reprcrash", None)
        entry["message"] = crash.message if crash is not None else str(report.longrepr)[-300:]
        entry["report"] = report.longreprtext[-20000:]
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
        entry["message"] = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else ""


def pytest_sessionfinish(session, exitstatus):
    with open(_RESULTS, "w") as f:
        json.dump(_reports, f, indent=1)
'''


def inject_our_config(test_module: Path) -> None:
    """Append our (config class, kwargs) to the module's ALL_CONFIGS, right after the list's definition."""
    source = test_module.read_text()
    match = re.search(r"^ALL_CONFIGS = \[\n.*?^\]\n", source, flags=re.S | re.M)
    if match is None:
        raise SystemExit(f"{test_module}: no top-level `ALL_CONFIGS = [...]` list found; is this PEFT's tests dir?")
    injected = (
        "\n# --- injected by peft-softprompt-plus tests/run_peft_generic.py ---\n"
        "import peft_softprompt_plus  # noqa: E402\n\n"
        f"ALL_CONFIGS.append((peft_softprompt_plus.SoftPromptPlusConfig, {OUR_CONFIG_KWARGS!r}))\n"
    )
    test_module.write_text(source[: match.end()] + injected + source[match.end() :])


def widen_mixed_batch_gates(tests: Path) -> None:
    for file, gate, widened in MIXED_BATCH_GATES:
        source = (tests / file).read_text()
        if gate not in source:
            print(f"Note: {file} has no gate {gate.splitlines()[0]!r}; left as it is")
            continue
        (tests / file).write_text(source.replace(gate, widened))


def referenced_model_ids(test_module: Path) -> set[str]:
    return set(re.findall(r'"((?:hf|peft|trl)-internal-testing/[\w.-]+)"', test_module.read_text()))


def build_models(root: Path, model_ids: list[str]) -> None:
    import torch
    import transformers

    for model_id in model_ids:
        target = root / model_id
        if (target / "config.json").exists():
            continue
        config_cls, kwargs = LOCAL_MODELS[model_id]
        config = getattr(transformers, config_cls)(**kwargs)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        model.save_pretrained(target)


def summarize(results: dict, wall: float) -> int:
    outcomes = Counter(r["outcome"] for r in results.values())
    failures = {node: r for node, r in results.items() if r["outcome"] in ("failed", "error")}

    def name(node: str) -> str:
        return node.split("::")[-1].split("[")[0]

    def is_expected(node: str, r: dict) -> bool:
        entry = EXPECTED_FAILURES.get(name(node))
        return entry is not None and re.search(entry[0], r.get("report", r["message"])) is not None

    expected = {node: r for node, r in failures.items() if is_expected(node, r)}
    unexpected = {node: r for node, r in failures.items() if not is_expected(node, r)}
    ran_names = {name(node) for node, r in results.items() if r["outcome"] != "skipped"}
    # Entries may hold for some models only (the mixed-batch ones); stale = ran, and failed as expected nowhere.
    stale = sorted(n for n in EXPECTED_FAILURES if n in ran_names and n not in {name(node) for node in expected})

    print(f"\n=== PEFT generic decoder tests x SOFTPROMPT_PLUS: {len(results)} tests in {wall:.0f} s ===")
    print(", ".join(f"{outcomes.get(k, 0)} {k}" for k in ("passed", "failed", "error", "skipped")))
    if expected:
        print(f"\nExpected failures (documented design differences): {len(expected)}")
        for test in sorted({name(n) for n in expected}):
            count = sum(name(n) == test for n in expected)
            print(f"  {test} (x{count}): {EXPECTED_FAILURES[test][1]}")
    skipped = Counter((name(n), r["message"]) for n, r in results.items() if r["outcome"] == "skipped")
    if skipped:
        print(f"\nSkipped by PEFT's own conditions: {sum(skipped.values())}")
        for (test, why), count in sorted(skipped.items()):
            print(f"  {test} (x{count}): {why[:150]}")
    if stale:
        print(f"\nListed as expected failures but none failed so (check the table): {', '.join(stale)}")
    missing = sorted(n for n in EXPECTED_FAILURES if n not in ran_names)
    if missing and results:
        print(f"\nListed as expected failures but not run: {', '.join(missing)}")
    if unexpected:
        print(f"\nUNEXPECTED failures: {len(unexpected)}")
        for node, r in sorted(unexpected.items()):
            print(f"  {node}\n      {r['message'].splitlines()[0][:300] if r['message'] else ''}")
        return 1
    if not results:
        print("\nNo test ran.")
        return 1
    print("\nOnly expected failures.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peft-tests", required=True, type=Path, help="the tests/ folder of a PEFT checkout")
    parser.add_argument("--work", type=Path, help="scratch folder to use and keep (default: temporary)")
    parser.add_argument("--models", default="", help="comma-separated substrings of model ids to keep")
    parser.add_argument(
        "--peft-gates", action="store_true", help="keep PEFT's LoRA-only gates of the mixed-adapter-batch tests"
    )
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("-x", action="store_true", help="stop at the first failure")
    parser.add_argument("--pytest-args", default="", help="further pytest arguments, one string")
    args = parser.parse_args(argv)

    peft_tests = args.peft_tests.resolve()
    missing = [f for f in PEFT_TEST_FILES if not (peft_tests / f).is_file()]
    if missing:
        raise SystemExit(f"--peft-tests {peft_tests}: missing {missing}; pass the tests/ folder of a PEFT checkout")

    work = args.work.resolve() if args.work else Path(tempfile.mkdtemp(prefix="peft_generic_"))
    try:
        tests = work / "tests"
        shutil.rmtree(tests, ignore_errors=True)
        tests.mkdir(parents=True)
        for f in PEFT_TEST_FILES + tuple(f for f in PEFT_OPTIONAL_FILES if (peft_tests / f).is_file()):
            shutil.copy(peft_tests / f, tests / f)
        (tests / "__init__.py").touch()
        inject_our_config(tests / "test_decoder_models.py")
        if not args.peft_gates:
            widen_mixed_batch_gates(tests)
        (work / "conftest.py").write_text(CONFTEST)
        (work / "pytest.ini").write_text("[pytest]\n")

        wanted = [s.strip().lower() for s in args.models.split(",") if s.strip()]
        ids = sorted(
            m
            for m in referenced_model_ids(tests / "test_decoder_models.py")
            if m in LOCAL_MODELS and (not wanted or any(w in m.lower() for w in wanted))
        )
        unbuilt = sorted(referenced_model_ids(tests / "test_decoder_models.py") - set(LOCAL_MODELS))
        if unbuilt:
            print(f"No local build (their tests are deselected): {', '.join(unbuilt)}")
        build_models(work, ids)
        print(f"Local models: {', '.join(ids)}\nScratch folder: {work}")

        results_file = work / "results.json"
        results_file.unlink(missing_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            HF_HUB_DISABLE_TELEMETRY="1",
            SPP_GENERIC_MODELS=json.dumps(ids),
            SPP_GENERIC_RESULTS=str(results_file),
        )
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "tests/test_decoder_models.py"]
        cmd += ["-x"] if args.x else []
        cmd += ["-k", args.keyword] if args.keyword else []
        cmd += shlex.split(args.pytest_args)
        print("$ " + shlex.join(cmd), flush=True)
        start = time.monotonic()
        subprocess.run(cmd, cwd=work, env=env, check=False)
        wall = time.monotonic() - start
        results = json.loads(results_file.read_text()) if results_file.exists() else {}
        return summarize(results, wall)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""The documented paths warn about nothing the user did: each runs with every warning turned into an error and no
WARNING log record allowed, so a warning that appears in a new release of anything fails here first.

Paths: the README's "Use" snippet, docs/quickstart.md (train, save, `PeftModel.from_pretrained`,
`AutoPeftModelForCausalLM`, left-padded generate), docs/distillation.md (plain mode), the demo and
examples/train_with_trainer.py (in process, and as
commands in fresh processes). Import-time warnings of third-party packages are out of scope (the imports ran before
any test): bitsandbytes' import makes torch.jit raise DeprecationWarnings that Python's default filters hide.
"""

import importlib.util
import io
import logging
import os
import re
import subprocess
import sys
import warnings
from contextlib import redirect_stdout

import pytest
import torch
from _versions import HAS_NEW_NAMES
from conftest import random_ids
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from peft_softprompt_plus import DistillOptions, SoftPromptPlusConfig, distill_prompt, student_inputs
from peft_softprompt_plus.apps.demo import run_demo
from peft_softprompt_plus.forward import attention

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "train_with_trainer.py")


def _quietly(path, caplog):
    """Run `path()` with warnings as errors; returns the WARNING (and worse) log records it left."""
    hf_logging.warning_once.cache_clear()  # a once-only warning printed by an earlier test must show again here
    attention.log_once.cache_clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING), warnings.catch_warnings():
        warnings.simplefilter("error")
        path()
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]


def readme_use(model_dir: str, tmp) -> None:
    gpt2 = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = random_ids(2, 6)
    mask = torch.ones_like(ids)
    model = get_peft_model(gpt2, SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=20))
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20)
    model.save_pretrained(os.path.join(tmp, "adapter"))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), os.path.join(tmp, "adapter"))
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3)


def quickstart(model_dir: str, tmp) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    gpt2 = AutoModelForCausalLM.from_pretrained(model_dir)
    model = get_peft_model(gpt2, SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=20))
    with redirect_stdout(io.StringIO()):
        model.print_trainable_parameters()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    batch = tok(["the movie was great"], return_tensors="pt")
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    folder = os.path.join(tmp, "my-prompt")
    model.save_pretrained(folder)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), folder)
    model = AutoPeftModelForCausalLM.from_pretrained(folder)
    tok.padding_side = "left"
    batch = tok(["the movie was", "a"], return_tensors="pt", padding=True)
    model.generate(**batch, max_new_tokens=5, pad_token_id=tok.pad_token_id)
    model.base_model.prompt("default")


def demo(model_dir: str, tmp) -> None:
    run_demo(steps=3, pretrain_steps=3, out_dir=os.path.join(tmp, "demo"), progress=False)


def trainer_example(model_dir: str, tmp) -> None:
    spec = importlib.util.spec_from_file_location("train_with_trainer", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with redirect_stdout(io.StringIO()):
        example.main(["--output-dir", str(tmp), "--steps", "2", "--num-virtual-tokens", "4"])


def distillation(model_dir: str, tmp) -> None:
    # docs/distillation.md in plain mode (the tiny GPT-2 has no chat template): distill, save, reload, generate.
    tok = AutoTokenizer.from_pretrained(model_dir)
    turns = ["how do I reset it", "what does it cost", "is it safe", "where is my order", "can I return it"]
    options = DistillOptions(num_virtual_tokens=2, steps=2, chat=False, samples_per_turn=1, max_new_tokens=4)
    model = distill_prompt(
        AutoModelForCausalLM.from_pretrained(model_dir),
        tok,
        "you are a kind and brief support assistant",
        options,
        user_turns=turns,
    )
    folder = os.path.join(tmp, "distilled")
    model.save_pretrained(folder)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), folder)
    batch = student_inputs(tok, ["how do I reset it", "hi"], chat=False)
    model.generate(**batch, max_new_tokens=3, pad_token_id=tok.pad_token_id)


PATHS = {
    "readme_use": readme_use,
    "quickstart": quickstart,
    "demo": demo,
    "trainer_example": trainer_example,
    "distillation": distillation,
}


@pytest.mark.parametrize("name", sorted(PATHS))
def test_a_documented_path_raises_no_warning(name, tiny_model_dir, tmp_path, caplog):
    assert _quietly(lambda: PATHS[name](tiny_model_dir, str(tmp_path)), caplog) == []


def test_the_harness_catches_the_warnings_we_removed(tiny_model_dir, make_base, caplog):
    # The reference: the same calls where nothing of ours removes them. PEFT's own FutureWarning for LoRA ...
    lora = LoraConfig(target_modules=["c_attn"], fan_in_fan_out=True)
    if HAS_NEW_NAMES:  # transformers 5.24+ deprecates the name PEFT reads; older releases have nothing to remove
        with pytest.raises(FutureWarning, match="is_gradient_checkpointing"):
            _quietly(lambda: get_peft_model(make_base(), lora), caplog)
    # ... and transformers' log line for a GPT-2 without a loss_type, trained as it comes.
    ids = random_ids(1, 4)
    logged = _quietly(lambda: make_base()(input_ids=ids, labels=ids), caplog)
    assert any("`loss_type=None` was set in the config but it is unrecognized" in line for line in logged), logged


COMMANDS = {  # fresh processes: the example imports PEFT before this package, as isort orders it
    "softprompt-plus demo": ["-m", "peft_softprompt_plus", "demo", "--steps", "5", "--output-dir", "{tmp}/a"],
    "train_with_trainer.py": [EXAMPLE, "--steps", "2", "--output-dir", "{tmp}/b"],
}
# What a third-party package prints when it is imported is not ours to judge (bitsandbytes with `kernels` installed
# logs a failed Hub kernel fetch offline; docs/troubleshooting.md says how to quiet it). The launcher imports that
# stack first, writes a mark, then runs the command as `python ...` would: only what comes after the mark is judged.
# PEFT stays out of the stack, so the order in which PEFT and this package meet is the command's own.
MARK = "--- third-party imports done ---"
THIRD_PARTY = ("torch", "transformers", "accelerate", "kernels", "bitsandbytes")
LAUNCHER = f"""
import importlib, runpy, sys
for name in {THIRD_PARTY!r}:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
sys.stderr.write({MARK!r} + "\\n")
sys.stderr.flush()
target, sys.argv = sys.argv[1], sys.argv[1:]
if target == "-m":
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    runpy.run_path(target, run_name="__main__")
"""


def _stderr_after_the_stack(argv: list[str], env: dict) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", LAUNCHER, *argv], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert MARK in done.stderr, done.stderr[-2000:]
    ours = done.stderr.split(MARK, 1)[1]
    return [line.strip() for line in re.split(r"[\r\n]+", ours) if line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_documented_command_prints_only_its_progress_bars(name, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    argv = [a.format(tmp=tmp_path) for a in COMMANDS[name]]
    lines = _stderr_after_the_stack(argv, env)
    assert [line for line in lines if not re.search(r"\d+/\d+ \[", line)] == []  # tqdm's bars, nothing else


@pytest.mark.slow
def test_the_judge_sees_a_line_our_code_prints(tmp_path):
    # The same launcher and filter, on a command that prints one stray line after the stack: it must be caught.
    script = tmp_path / "stray.py"
    script.write_text("import sys\nimport peft_softprompt_plus\nprint('stray', file=sys.stderr)\n")
    assert _stderr_after_the_stack([str(script)], dict(os.environ)) == ["stray"]


QUIET_RECIPE = """import logging

for name in ("bitsandbytes", "kernels"):
    logging.getLogger(name).setLevel(logging.ERROR)
"""


def test_third_party_import_lines_are_the_documented_ones_and_the_recipe_quiets_them():
    # docs/troubleshooting.md quotes what importing the stack offline may print, and gives this recipe to quiet it.
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    def stderr_of(code: str) -> str:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr
        return done.stderr

    loud = stderr_of("import peft, transformers")
    assert stderr_of(QUIET_RECIPE + "import peft, transformers") == ""
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "troubleshooting.md")).read()
    assert QUIET_RECIPE in doc  # the docs give exactly the recipe tested here
    for line in filter(None, (line.strip() for line in loud.splitlines())):
        assert line[:60] in doc, f"a third-party import line docs/troubleshooting.md doesn't quote: {line!r}"

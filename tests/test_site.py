"""Registration without an import (`_site/`): `softprompt-plus run -- COMMAND` registers the method in every Python
process COMMAND starts, keeps a `sitecustomize` it shadows, and passes the exit status through; the `autoload` hook
registers when PEFT is imported and imports nothing heavy before that.

Each check starts a fresh interpreter under `python -S` plus this environment's site-packages, so the programs see
what a tool that never imports this package sees (no `.pth` start-up hook of ours, no `conftest` import)."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import textwrap

import pytest
import torch
from peft import get_peft_model

import peft_softprompt_plus
from peft_softprompt_plus import SoftPromptPlusConfig
from peft_softprompt_plus.apps import cli
from peft_softprompt_plus.apps.tiny import save_tiny, tiny_gpt2

SITE_PACKAGES = [p for p in site.getsitepackages() if os.path.isdir(p)]
SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(peft_softprompt_plus.__file__)))  # `src/` (editable install)


def _env(**extra) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


def _bare_python(code: str) -> list[str]:
    """`python -S` with site-packages added by hand: no `.pth` start-up hooks, so only what a test sets up runs."""
    paths = SITE_PACKAGES + [SOURCE]
    prelude = f"import sys; sys.path[len(sys.path):] = {paths!r}\n"
    return [sys.executable, "-S", "-c", prelude + textwrap.dedent(code)]


def _softprompt_plus_run(*command: str, env: dict) -> subprocess.CompletedProcess:
    """`softprompt-plus run -- COMMAND`, started as its console script would be."""
    launcher = [sys.executable, "-m", "peft_softprompt_plus.apps.cli", "run", "--", *command]
    return subprocess.run(launcher, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny base and a trained-looking adapter on disk, and the logits the library gives for them."""
    root = tmp_path_factory.mktemp("site")
    save_tiny(str(root / "base"))
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    for folder, level in (("adapter", "input"), ("adapter_kv", "kv")):  # a KV prompt loads through the same hook
        config = SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, init_seed=1, prompt_level=level)
        get_peft_model(tiny_gpt2(), config).save_pretrained(root / folder)
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "base"), root / folder)
        with torch.no_grad():
            logits = loaded(input_ids=torch.tensor([[5, 6, 7]])).logits
        torch.save(logits, root / f"expected_{folder}.pt")
    return root


# A program that never imports peft_softprompt_plus: it loads the adapter with PEFT alone, as lm-eval or a
# serving loader does, and starts a child Python that does the same.
LOADER = """
import subprocess, sys
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

root = sys.argv[1]
for folder in ("adapter", "adapter_kv"):
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root + "/base"), root + "/" + folder)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5, 6, 7]])).logits
    print(folder, "max diff", (logits - torch.load(root + f"/expected_{folder}.pt")).abs().max().item())
child = [sys.executable, "-c", "import sys; from peft import PeftConfig; "
         "print('child', PeftConfig.from_pretrained(sys.argv[1]).peft_type.value)", root + "/adapter"]
print(subprocess.run(child, capture_output=True, text=True, check=True).stdout.strip())
"""


@pytest.mark.slow
def test_run_registers_in_the_program_and_the_processes_it_starts(saved, tmp_path):
    script = tmp_path / "loader.py"
    script.write_text(LOADER)

    if os.path.exists(os.path.join(cli.sysconfig.get_paths()["purelib"], cli.AUTOLOAD_PTH)):
        pytest.skip("`softprompt-plus autoload on` registers every process of this environment")
    alone = subprocess.run(
        [sys.executable, str(script), str(saved)], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert alone.returncode != 0 and "SOFTPROMPT_PLUS" in alone.stderr  # PEFT alone doesn't know the method

    wrapped = _softprompt_plus_run(sys.executable, str(script), str(saved), env=_env())
    assert wrapped.returncode == 0, wrapped.stderr[-3000:]
    assert "adapter max diff 0.0" in wrapped.stdout and "adapter_kv max diff 0.0" in wrapped.stdout
    assert "child SOFTPROMPT_PLUS" in wrapped.stdout  # the child inherited the start-up hook


def test_run_keeps_the_sitecustomize_it_shadows_and_the_exit_status(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIR_SITECUSTOMIZE'] = 'ran'\n")
    code = "import os, sys; print(os.environ.get('THEIR_SITECUSTOMIZE')); sys.exit(7)"

    result = _softprompt_plus_run(sys.executable, "-c", code, env=_env(PYTHONPATH=str(theirs)))

    assert result.stdout.strip() == "ran"
    assert result.returncode == 7


def test_run_imports_nothing_heavy_until_peft_is_imported():
    code = (
        "import sys; heavy = [m for m in ('torch', 'transformers', 'peft', 'peft_softprompt_plus.method.tuner') "
        "if m in sys.modules]; print('before', heavy); import peft; "
        "from peft.utils.peft_types import PeftType; print('after', PeftType('SOFTPROMPT_PLUS').value)"
    )
    result = _softprompt_plus_run(sys.executable, "-c", code, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "before []" in result.stdout
    assert "after SOFTPROMPT_PLUS" in result.stdout


def test_autoload_line_registers_when_peft_is_imported_and_not_before(tmp_path):
    # What `autoload on` writes, processed the way site-packages' `.pth` files are at start-up.
    (tmp_path / cli.AUTOLOAD_PTH).write_text(cli.AUTOLOAD_LINE)
    code = f"""
        import site, sys
        site.addsitedir({str(tmp_path)!r})
        print("before", [m for m in ("torch", "transformers", "peft") if m in sys.modules])
        from peft.utils.peft_types import PeftType
        print("after", PeftType("SOFTPROMPT_PLUS").value)
    """
    result = subprocess.run(_bare_python(code), env=_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "before []" in result.stdout
    assert "after SOFTPROMPT_PLUS" in result.stdout


def test_autoload_on_off_status_write_and_remove_only_its_hook(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli.sysconfig, "get_paths", lambda: {"purelib": str(tmp_path)})
    (tmp_path / "someone_else.pth").write_text("import os\n")
    hook = tmp_path / cli.AUTOLOAD_PTH

    assert cli.main(["autoload", "status"]) == 0 and not hook.exists()
    assert "autoload is off" in capsys.readouterr().out
    assert cli.main(["autoload", "on"]) == 0
    assert hook.read_text() == cli.AUTOLOAD_LINE and "autoload is on" in capsys.readouterr().out
    assert cli.main(["autoload", "on"]) == 0 and hook.read_text() == cli.AUTOLOAD_LINE  # idempotent
    assert cli.main(["autoload", "off"]) == 0 and not hook.exists()
    assert "autoload is off" in capsys.readouterr().out
    assert cli.main(["autoload", "off"]) == 0  # already off: nothing to remove
    assert sorted(p.name for p in tmp_path.iterdir()) == ["someone_else.pth"]


# `get_peft_model` on a Hub id instead of a model: PEFT's own function fails on `model.__dict__` before anything of
# ours runs, so the clear error needs the patched function bound, and `from peft import get_peft_model` binds what
# `peft` holds at that moment (docs/troubleshooting.md).
HUB_ID_ATTACH = """
{first}
{second}
try:
    get_peft_model("gpt2", SoftPromptPlusConfig(task_type="CAUSAL_LM"))
except Exception as err:
    print(type(err).__name__, err)
"""
PEFT_FIRST = ("from peft import get_peft_model", "from peft_softprompt_plus import SoftPromptPlusConfig")
CLEAR = "TypeError `model` must be a torch.nn.Module (a loaded transformers model), got str 'gpt2'"


@pytest.mark.slow
def test_the_clear_error_for_a_hub_id_in_either_import_order(tmp_path):
    peft_first = HUB_ID_ATTACH.format(first=PEFT_FIRST[0], second=PEFT_FIRST[1])
    ours_first = HUB_ID_ATTACH.format(first=PEFT_FIRST[1], second=PEFT_FIRST[0])
    (tmp_path / cli.AUTOLOAD_PTH).write_text(cli.AUTOLOAD_LINE)
    autoload = f"import site; site.addsitedir({str(tmp_path)!r})\n"

    def output(command):
        done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    assert CLEAR in output(_bare_python(ours_first))
    # The limitation: PEFT's unpatched function was bound before this package ran.
    assert "AttributeError 'str' object has no attribute '__dict__'" in output(_bare_python(peft_first))
    # The fixes: registration at `import peft`, before the name is bound.
    assert CLEAR in output(_bare_python(autoload + peft_first))
    assert CLEAR in _softprompt_plus_run(sys.executable, "-c", peft_first, env=_env()).stdout

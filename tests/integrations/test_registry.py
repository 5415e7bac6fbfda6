"""Registration with PEFT (integrations/peft_registry.py): a real `PeftType` member, idempotent imports."""

import importlib
import inspect
import os
import subprocess
import sys

import peft
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
from peft.utils import PeftType

import peft_softprompt_plus


def _peft_alone(code: str) -> subprocess.CompletedProcess:
    """Runs `code` where PEFT is importable but this package never registers: `-S` skips every .pth start-up hook
    (`softprompt-plus autoload on` is one), and the import path is this one's, minus `softprompt-plus run`'s."""
    path = [p for p in sys.path if p and "_site" not in p]
    prelude = f"import sys; sys.path[:] = {path!r}\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-S", "-c", prelude + code], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip


def test_peft_type_member():
    member = PeftType("SOFTPROMPT_PLUS")
    assert member is PeftType.SOFTPROMPT_PLUS is peft_softprompt_plus.SOFTPROMPT_PLUS
    assert member == "SOFTPROMPT_PLUS" and member.name == "SOFTPROMPT_PLUS"
    assert "SOFTPROMPT_PLUS" in list(PeftType) and member in PeftType
    assert list(PeftType).count(member) == 1
    assert PEFT_TYPE_TO_CONFIG_MAPPING[member] is peft_softprompt_plus.SoftPromptPlusConfig
    assert PEFT_TYPE_TO_TUNER_MAPPING[member] is peft_softprompt_plus.SoftPromptPlusModel

    # PEFT's own members keep their values and order: compare with PEFT imported alone in a fresh interpreter.
    alone = _peft_alone("from peft.utils import PeftType; print(' '.join(f'{m.name}={m.value}' for m in PeftType))")
    assert alone.returncode == 0, alone.stderr[-2000:]
    ours = [f"{m.name}={m.value}" for m in PeftType if m is not member]
    assert ours == alone.stdout.split()


def test_reimport_and_reload_are_harmless(make_base):
    members = len(PeftType)
    importlib.reload(importlib.import_module("peft_softprompt_plus.integrations.peft_registry"))
    reloaded = importlib.reload(peft_softprompt_plus)
    assert len(PeftType) == members
    model = peft.get_peft_model(
        make_base(), reloaded.SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    )
    assert type(model.base_model) is reloaded.SoftPromptPlusModel
    original = peft.PeftModel.save_pretrained._softprompt_plus_original  # patched once, not wrapped twice
    assert original.__module__ == "peft.peft_model" and not hasattr(original, "_softprompt_plus_original")


def test_loading_without_the_import_fails_as_documented(tmp_path):
    """The model card's first line exists because PEFT alone can't load this type: pin down that failure."""
    code = (
        "import json, pathlib, sys\n"
        f"p = pathlib.Path({str(tmp_path)!r})\n"
        "(p / 'adapter_config.json').write_text(json.dumps({'peft_type': 'SOFTPROMPT_PLUS'}))\n"
        "from peft import PeftConfig\n"
        "try:\n    PeftConfig.from_pretrained(str(p))\nexcept KeyError as e:\n    print('KeyError', e)\n"
    )
    out = _peft_alone(code)
    assert "KeyError" in out.stdout, out.stderr[-2000:]


def test_enum_extension_on_a_fresh_str_enum():
    """The shim itself, on an enum PEFT never sees: lookup by value and name, iteration, idempotence."""
    import enum
    import pickle

    from peft_softprompt_plus.integrations.peft_registry import _extend_str_enum

    class Kind(str, enum.Enum):
        A = "A"

    member = _extend_str_enum(Kind, "X", "X")
    assert _extend_str_enum(Kind, "X", "X") is member
    assert Kind("X") is Kind["X"] is Kind.X is member
    assert list(Kind) == [Kind.A, member] and len(Kind) == 2
    assert member == "X" and hash(member) == hash("X")
    assert pickle.loads(pickle.dumps(PeftType.SOFTPROMPT_PLUS)) is PeftType.SOFTPROMPT_PLUS


# The parameters of every PEFT function in `PATCHES`, as the PEFT release `PEFT_CHECKED` defines them. Our
# replacements forward arguments by these names: a PEFT upgrade that renames, adds or reorders one fails here, loudly,
# instead of in a user's run.
PINNED_SIGNATURES = {
    "PeftModel.save_pretrained": "self save_directory safe_serialization selected_adapters save_embedding_layers "
    "is_main_process path_initial_model_for_weight_conversion **kwargs",
    "PeftModel.push_to_hub": "self repo_id *commit_message *commit_description *private *token *revision *create_pr "
    "*max_shard_size *tags",
    "PeftModel.create_or_update_model_card": "self output_dir",
    "PeftModel.__init__": "self model peft_config adapter_name autocast_adapter_dtype low_cpu_mem_usage",
    "PeftModel.from_pretrained": "cls model model_id adapter_name is_trainable config autocast_adapter_dtype "
    "ephemeral_gpu_offload low_cpu_mem_usage key_mapping **kwargs",
    "PeftModel.load_adapter": "self model_id adapter_name is_trainable torch_device autocast_adapter_dtype "
    "ephemeral_gpu_offload low_cpu_mem_usage key_mapping **kwargs",
    "PeftModel.set_adapter": "self adapter_name inference_mode",
    "PeftModel.delete_adapter": "self adapter_name",
    "peft.mapping_func.get_peft_model": "model peft_config adapter_name mixed autocast_adapter_dtype revision "
    "low_cpu_mem_usage",
    "peft.get_peft_model": "model peft_config adapter_name mixed autocast_adapter_dtype revision low_cpu_mem_usage",
    "peft.tuners.lora.variants.is_alora_relevant_in_batch": "model adapter_names",
}
_KIND_MARK = {inspect.Parameter.KEYWORD_ONLY: "*", inspect.Parameter.VAR_KEYWORD: "**"}


def _where(patch) -> str:
    owner = patch.owner.__name__
    return f"{owner}.{patch.name}"


def test_patched_peft_signatures_are_the_ones_we_checked():
    from peft_softprompt_plus.integrations.peft_registry import PATCHES, PEFT_CHECKED, _original

    assert sorted(_where(p) for p in PATCHES) == sorted(PINNED_SIGNATURES)
    for patch in PATCHES:
        params = inspect.signature(_original(patch.owner, patch.name)).parameters.values()
        seen = " ".join(_KIND_MARK.get(p.kind, "") + p.name for p in params)
        assert seen == PINNED_SIGNATURES[_where(patch)], (
            f"PEFT {peft.__version__} changed {_where(patch)} (checked against {PEFT_CHECKED}); review its patch"
        )
        assert patch.reason  # every patch says why it exists


def test_patches_are_visible_under_our_names():
    from peft_softprompt_plus.integrations.peft_registry import PATCHES

    for patch in PATCHES:
        installed = inspect.getattr_static(patch.owner, patch.name)
        installed = getattr(installed, "__func__", installed)
        assert installed.__name__ == patch.replacement.__name__ and installed.__name__.startswith("softprompt_plus_")
        assert installed._softprompt_plus_original.__module__.split(".")[0] in ("peft", "transformers")


def test_threads_loading_adapters_leave_the_process_s_warning_filters_as_they_were(make_peft, make_base, tmp_path):
    # PeftModel.__init__ hides PEFT's own deprecation warning for our adapters with catch_warnings, which saves and
    # restores the process-wide filter list: interleaved in threads (the serve front loads adapters from workers),
    # one thread's "ignore" could outlive its call. Our swaps take one lock.
    import threading
    import warnings

    from peft import PeftModel

    make_peft().save_pretrained(tmp_path / "a")
    bases = [make_base() for _ in range(16)]
    before, errors = list(warnings.filters), []

    def load(i: int) -> None:
        try:
            if i % 2:
                PeftModel.from_pretrained(bases[i], tmp_path / "a")
            else:
                make_peft(bases[i])
        except Exception as err:  # noqa: BLE001 - reported below, with the thread's index
            errors.append((i, err))

    threads = [threading.Thread(target=load, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and warnings.filters == before

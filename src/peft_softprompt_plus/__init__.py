"""peft-softprompt-plus: exact, fast, tie-safe soft prompts for decoder models, as a PEFT method.

`import peft_softprompt_plus` registers the `SOFTPROMPT_PLUS` method with PEFT (at once when PEFT is already
imported, else the moment it is); then use `get_peft_model`, `PeftModel.from_pretrained` and
`AutoPeftModelForCausalLM` as for any PEFT adapter. The public names below load on first use.
"""

from . import _moved
from ._site import hook as _hook

__version__ = "0.2.0"

_PUBLIC = {  # name -> the module that defines it
    "SOFTPROMPT_PLUS": "integrations.peft_registry",
    "SoftPromptPlusConfig": "method.config",
    "SoftPromptPlusModel": "method.tuner",
    "AdapterFileError": "files.loading",
    "GradientFlowCallback": "gradients.callbacks",
    "FINDING_CODES": "gradients.causes",
    "Finding": "gradients.findings",
    "GradientFlowError": "gradients.findings",
    "GradientFlowReport": "gradients.findings",
    "GradientFlowWarning": "gradients.findings",
    "check_gradient_flow": "gradients.flow",
    "KeepBest": "method.stopping",
    "FetchError": "apps.fetch",
    "fetch_checkpoint": "apps.fetch",
    "DistillOptions": "distill.options",
    "DistillReport": "distill.report",
    "distill_prompt": "distill.run",
    "student_inputs": "distill.data",
    "student_text": "distill.data",
    "prompt_embeds": "serve.embeds",
    "to_cartridge": "files.cartridge",
    "from_cartridge": "files.cartridge",
    "fold_kv_prompt": "files.fold",
    "check_fold_window": "files.fold",
    "fold_adapter": "files.fold",
    "save_folded": "files.fold",
    "pick_demonstrations": "method.demonstrations",
    "LeaveOneOutLogCallback": "integrations.trainer_log",
}
__all__ = sorted(_PUBLIC) + ["__version__"]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _hook.register_now()
    value = getattr(_hook.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


_hook.install()
_moved.install()

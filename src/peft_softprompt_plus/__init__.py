"""peft-softprompt-plus: exact, fast, tie-safe soft prompts for decoder models, as a PEFT method.

`import peft_softprompt_plus` registers the `SOFTPROMPT_PLUS` method with PEFT (at once when PEFT is already
imported, else the moment it is); then use `get_peft_model`, `PeftModel.from_pretrained` and
`AutoPeftModelForCausalLM` as for any PEFT adapter. The public names below load on first use.
"""

from ._site import hook as _hook

__version__ = "0.2.0"

_PUBLIC = {  # name -> the module that defines it
    "SOFTPROMPT_PLUS": "_peft_registry",
    "SoftPromptPlusConfig": "config",
    "SoftPromptPlusModel": "tuner",
    "AdapterFileError": "loading",
    "GradientFlowCallback": "callbacks",
    "FINDING_CODES": "gradient_checks",
    "Finding": "gradient_report",
    "GradientFlowError": "gradient_report",
    "GradientFlowReport": "gradient_report",
    "GradientFlowWarning": "gradient_report",
    "check_gradient_flow": "gradient_flow",
    "FetchError": "fetch",
    "fetch_checkpoint": "fetch",
    "DistillReport": "distill_score",
    "distill_prompt": "distill",
    "student_inputs": "distill_data",
    "student_text": "distill_data",
    "prompt_embeds": "serving",
}
__all__ = sorted(_PUBLIC) + ["__version__"]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _hook.register_now()
    value = getattr(_hook._import(f"{__name__}.{_PUBLIC[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


_hook.install()

"""peft-softprompt-plus: exact, fast, tie-safe soft prompts for GPT-2-style models, as a PEFT method.

`import peft_softprompt_plus` registers the `SOFTPROMPT_PLUS` method with PEFT; then use `get_peft_model`,
`PeftModel.from_pretrained` and `AutoPeftModelForCausalLM` as for any PEFT adapter.
"""

from ._peft_registry import SOFTPROMPT_PLUS, register
from .callbacks import GradientFlowCallback
from .config import SoftPromptPlusConfig
from .gradient_flow import (
    FINDING_CODES,
    Finding,
    GradientFlowError,
    GradientFlowReport,
    GradientFlowWarning,
    check_gradient_flow,
)
from .tuner import SoftPromptPlusModel

register(SoftPromptPlusConfig, SoftPromptPlusModel)

__version__ = "0.1.0"

__all__ = [
    "FINDING_CODES",
    "SOFTPROMPT_PLUS",
    "Finding",
    "GradientFlowCallback",
    "GradientFlowError",
    "GradientFlowReport",
    "GradientFlowWarning",
    "SoftPromptPlusConfig",
    "SoftPromptPlusModel",
    "__version__",
    "check_gradient_flow",
]

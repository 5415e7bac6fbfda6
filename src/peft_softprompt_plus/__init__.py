"""peft-softprompt-plus: exact, fast, tie-safe soft prompts for GPT-2-style models, as a PEFT method.

`import peft_softprompt_plus` registers the `SOFTPROMPT_PLUS` method with PEFT; then use `get_peft_model`,
`PeftModel.from_pretrained` and `AutoPeftModelForCausalLM` as for any PEFT adapter.
"""

from ._peft_registry import SOFTPROMPT_PLUS, register
from .config import SoftPromptPlusConfig
from .gradient_flow import GradientFlowError
from .tuner import SoftPromptPlusModel

register(SoftPromptPlusConfig, SoftPromptPlusModel)

__version__ = "0.1.0"

__all__ = [
    "SOFTPROMPT_PLUS",
    "GradientFlowError",
    "SoftPromptPlusConfig",
    "SoftPromptPlusModel",
    "__version__",
]

"""Registers `SoftPromptPlusConfig` and `SoftPromptPlusModel` with PEFT (imported once PEFT itself is imported)."""

from ..method.config import SoftPromptPlusConfig
from ..method.tuner import SoftPromptPlusModel
from .peft_registry import register

register(SoftPromptPlusConfig, SoftPromptPlusModel)

"""Registers `SoftPromptPlusConfig` and `SoftPromptPlusModel` with PEFT (imported once PEFT itself is imported)."""

from ._peft_registry import register
from .config import SoftPromptPlusConfig
from .tuner import SoftPromptPlusModel

register(SoftPromptPlusConfig, SoftPromptPlusModel)

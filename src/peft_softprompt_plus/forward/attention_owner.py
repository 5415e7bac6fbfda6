"""The one owner of a model's attention implementation. Attaching points `config._attn_implementation` at our kernel
(attention.py); `disable_adapter()` and `unload()` hand the model's own back; a caller that needs another kernel for
its own calls (eager's weights, for one) runs it for this thread and task alone (`running`), never by switching the
config every thread reads. No other module changes the implementation."""

from __future__ import annotations

import contextlib
from typing import Optional

from torch import nn
from transformers import PretrainedConfig

from . import attention, flash


def _kernel_for(implementation: Optional[str], flash_ok: bool) -> str:
    # Eager keeps the family's own eager code (soft-capping, `output_attentions`); flash_attention_2/3 keep flash where
    # its package imports (unless `flash_ok` is False). Every other kernel (flex, a Hub kernel, a user's own) can't
    # take a prompt that differs per row, so sdpa computes the same attention instead.
    if implementation == "eager" or (flash_ok and flash.library_for(implementation)):
        return implementation
    return "sdpa"


def _switch(model: nn.Module, implementation: Optional[str]) -> None:
    # transformers' public switch (it also reaches the sub-configs of composite models); a config that named no
    # implementation is left naming none again, and a bare module without the switch (never a transformers model)
    # gets the config field written.
    if implementation is not None and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(implementation)
    else:
        model.config._attn_implementation = implementation


def hand_back(model: nn.Module, implementation: Optional[str]) -> None:
    """`model` names `implementation` again, if it names one of our kernels now."""
    if attention.is_installed(getattr(model, "config", None)):
        _switch(model, implementation)


class AttentionOwner:
    """What a model's attention was before prompting (`original`, what `unload()` hands back) and the one place that
    switches it. Created at the tuner's first adapter; lives as long as the tuner."""

    def __init__(self, model: nn.Module):
        self.original: Optional[str] = model.config._attn_implementation
        self.flash_ok = True  # a flash_attention_2/3 model keeps flash for the prompt at the attention

    def install(self, model: nn.Module) -> None:
        """Our kernel for the original one. Idempotent. A config that names a kernel of neither ours nor the original
        was switched by the user since attach (`set_attn_implementation`): that one is handed back from then on."""
        own = model.config._attn_implementation
        if attention.is_installed(model.config):
            return
        if own != self.original:
            attention.log_once(
                f"The model's attention was switched to `{own}` while prompted: unload() hands it back."
            )
            self.original = own
        attention.register()
        kernel = _kernel_for(own, self.flash_ok)
        if kernel != own:
            attention.log_once(
                f"The soft prompt enters attention through sdpa; the model's `{own}` comes back on unload()."
            )
        _switch(model, attention.registered_name(kernel))

    def release(self, model: nn.Module) -> None:
        """The original implementation: `disable_adapter()`, the last adapter deleted, `unload()`."""
        hand_back(model, self.original)

    def without_flash(self, model: nn.Module) -> bool:
        """From now on our sdpa in place of flash; True when this changed the model's kernel."""
        if not self.flash_ok:
            return False
        self.flash_ok = False
        if not (attention.is_installed(model.config) and flash.library_for(self.original)):
            return False
        hand_back(model, self.original)
        self.install(model)
        return True

    @contextlib.contextmanager
    def running(self, model: nn.Module, kernel_name: str):
        """This thread's (and asyncio task's) calls of `model` run our `kernel_name` ('eager', 'sdpa', or a flash
        one) while an adapter is attached; every other caller runs what the config names. Nothing is switched, so
        nothing needs restoring."""
        if not attention.is_installed(model.config):
            raise RuntimeError(
                f"`running({kernel_name!r})` needs an attached, enabled adapter (the model's config names "
                f"{model.config._attn_implementation!r}); call it outside `disable_adapter()`."
            )
        configs = {
            id(m.config): m.config for m in model.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)
        }
        with attention.running(configs.values(), kernel_name):
            yield

"""The forward's state: one object the tuner holds (`tuner.forward_state`), with methods the tuner, the forward, the
gradient probe and loading call. It owns whether the prompt enters at the attention, what prompting changed on the
base model (so it can be handed back), each adapter's stored prompt pass, the `adapter_names` of the call in flight,
the one `grad_disabled` warning, the leave-one-out counts and their one warning, and where an adapter being loaded
comes from. No module writes another's private attributes."""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from dataclasses import dataclass
from typing import Optional

from torch import nn

from . import attention, attention_owner, generation, kv_pass
from .generation import PromptKVStore

# Leave-one-out rows that may pass without one demonstration among them before the one warning: a few-shot run's rows
# are all demonstrations; a many-shot run with k of R rows as demonstrations meets one in R/k rows on average.
UNMATCHED_WARNING_ROWS = 256


@dataclass
class BaseSettings:
    """What prompting changes on a base model: its `requires_grad` flags, attention implementation and `loss_type`.
    Captured before a change, restored to hand the model back exactly as it came."""

    requires_grad: dict[str, bool]
    attention: Optional[str]
    loss_type: Optional[str]

    @classmethod
    def capture(cls, model: nn.Module) -> BaseSettings:
        config = getattr(model, "config", None)
        return cls(
            {name: p.requires_grad for name, p in model.named_parameters()},
            getattr(config, "_attn_implementation", None),
            getattr(model, "loss_type", None),
        )

    def restore_flags(self, model: nn.Module) -> None:
        for name, param in model.named_parameters():
            param.requires_grad_(self.requires_grad.get(name, param.requires_grad))

    def restore_loss(self, model: nn.Module) -> None:
        if hasattr(model, "loss_type"):
            model.loss_type = self.loss_type

    def restore(self, model: nn.Module) -> None:
        self.restore_flags(model)
        attention_owner.hand_back(model, self.attention)
        self.restore_loss(model)


class ForwardState:
    """See the module docstring. Created with the tuner's first adapter; lives as long as the tuner."""

    def __init__(self, model: nn.Module):
        self.base = BaseSettings.capture(model)  # as the model came: `unload()` hands this back
        self.attention = attention_owner.AttentionOwner(model)  # the only code that switches its implementation
        self.kv_store = PromptKVStore()
        self.attention_path = False  # whether the prompt enters at the attention (else it is concatenated)
        self.kv_layout: Optional[kv_pass.KVLayout] = None  # the attention layers a prompt's keys/values go to
        self._before_prompting: Optional[BaseSettings] = None
        self._generate_hook = None
        self._per_call()
        self._grad_warning_due = True
        self._encoder_source: Optional[tuple] = None
        # Training rows whose adapter does leave-one-out, and how many of them were one of its demonstrations.
        self.leave_one_out = {"matched": 0, "unmatched": 0}
        self._unmatched_warning_due = True

    def _per_call(self) -> None:
        # Per call, so threads calling one model at once never read each other's: context variables of this model's.
        self._call_adapter_names = contextvars.ContextVar(f"adapter_names_{id(self)}", default=None)
        self._last_kernels = contextvars.ContextVar(f"last_kernels_{id(self)}", default=frozenset())
        self._regularizing = contextvars.ContextVar(f"regularizing_{id(self)}", default=True)

    def __getstate__(self) -> dict:
        # `torch.save(model)` and `copy.deepcopy(model)` take the state; a context variable can't be copied, and the
        # copy starts with no call in flight.
        per_call = ("_call_adapter_names", "_last_kernels", "_regularizing")
        return {k: v for k, v in self.__dict__.items() if k not in per_call}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._per_call()

    # ------------------------------------------------------------------ prompting on and off

    def start(self, model: nn.Module, task) -> None:
        """The first prompt: freeze the base, install our attention and the task's loss alias."""
        self._before_prompting = BaseSettings.capture(model)
        task.on_attach(model)
        model.requires_grad_(False)
        self.attention.install(model)
        self.kv_layout = kv_pass.probe_layout(model)
        self.attention_path = self.kv_layout is not None
        self._generate_hook = generation.install_hook(model)
        if not self.attention_path:
            self.attention.release(model)
            attention.log_once(
                f"{type(model).__name__} computes attention outside transformers' attention registry: its soft "
                "prompt is concatenated to every row (forward_path='concat')."
            )

    def stop(self, model: nn.Module) -> None:
        """No prompt left: the model's own attention and loss come back, so it computes the base model exactly."""
        self.attention.release(model)
        self.base.restore_loss(model)
        self.kv_store.drop()
        if self._generate_hook is not None:
            self._generate_hook.remove()
            self._generate_hook = None

    def roll_back(self, model: nn.Module) -> None:
        """A failed first attach: as `stop`, and the `requires_grad` flags the model had before it."""
        self.stop(model)
        if self._before_prompting is not None:
            self._before_prompting.restore_flags(model)

    def unload(self, model: nn.Module) -> None:
        self.stop(model)
        self.base.restore_flags(model)

    def pause_attention(self, model: nn.Module) -> None:
        """`disable_adapter()`: the model's own attention while it runs as the base model (a switch every thread sees,
        as the disabled adapter is)."""
        self.attention.release(model)

    def without_flash(self, model: nn.Module) -> None:
        """Our flash path for a prompt at the attention is checked on a CPU stand-in only, and a KV prompt has no
        concatenation to fall back on: from the first KV adapter on, a flash model reads every prompt through sdpa."""
        if self.attention.without_flash(model):
            attention.log_once(
                f"A KV prompt on a model loaded with `{self.attention.original}` reads its keys/values through our "
                "sdpa (our flash path for a prompt is checked on a CPU stand-in, not yet on hardware)."
            )

    def ensure_attention(self, model: nn.Module) -> None:
        """Ours again when the adapter was disabled, or the user switched the implementation since attach."""
        if self.attention_path:
            self.attention.install(model)

    # ------------------------------------------------------------------ the call in flight

    @contextlib.contextmanager
    def routing(self, adapter_names):
        """PeftModel hands `adapter_names` to the tuner's hook and strips it from what reaches forward/generate; kept
        per thread (and asyncio task)."""
        token = self._call_adapter_names.set(adapter_names)
        try:
            yield
        finally:
            self._call_adapter_names.reset(token)

    @property
    def adapter_names(self):
        return self._call_adapter_names.get()

    def record_kernels(self, prompt_kv) -> None:
        """Which attention the last forward ran (`last_kernels`): `sdpa_lower_right` (one prompt, no padding: no
        mask tensor), `sdpa_mask` / `eager_mask` (one explicit mask per forward, shared by the layers), or `concat`."""
        self._last_kernels.set(frozenset(prompt_kv.kernels) if prompt_kv is not None else frozenset({"concat"}))

    @property
    def last_kernels(self) -> frozenset:
        """Which attention the last forward of this thread ran (see `record_kernels`)."""
        return self._last_kernels.get()

    @contextlib.contextmanager
    def regularizers_off(self):
        """The gradient probe asks whether the gradient can reach every prompt position: while it runs (this thread
        only), a training forward reads every position, with no leave-one-out or position dropout."""
        token = self._regularizing.set(False)
        try:
            yield
        finally:
            self._regularizing.reset(token)

    @property
    def regularizing(self) -> bool:
        """Whether a training forward of this thread applies the KV regularisers (kv_regularize.py)."""
        return self._regularizing.get()

    def count_leave_one_out(self, matched: int, unmatched: int) -> None:
        """Count a training forward's leave-one-out rows (kv_regularize.py); once `UNMATCHED_WARNING_ROWS` of them
        have run and none was a demonstration, warn once: leave-one-out has masked nothing."""
        self.leave_one_out["matched"] += matched
        self.leave_one_out["unmatched"] += unmatched
        seen = self.leave_one_out["matched"] + self.leave_one_out["unmatched"]
        if self._unmatched_warning_due and seen >= UNMATCHED_WARNING_ROWS and not self.leave_one_out["matched"]:
            self._unmatched_warning_due = False
            warnings.warn(
                f"kv_leave_one_out=True, but none of the first {seen} training rows matched a demonstration, so "
                "leave-one-out has masked nothing. A row matches when its real ids equal one of the adapter's "
                "`demonstration_ids` (tokenized alone: no BOS, no separator), or when a `demonstration_index` column "
                "names it (-1: none). Check that the collator adds no tokens, or pass kv_leave_one_out=False where "
                "the demonstrations are not training rows. The counts: model.base_model.forward_state.leave_one_out.",
                UserWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------------ the one grad_disabled warning

    def take_grad_warning(self) -> bool:
        """True once per model: the caller warns then."""
        due, self._grad_warning_due = self._grad_warning_due, False
        return due

    @contextlib.contextmanager
    def grad_warning_held(self):
        """The probe runs forwards under `no_grad` on purpose: they must not use up the user's one warning."""
        due, self._grad_warning_due = self._grad_warning_due, False
        try:
            yield
        finally:
            self._grad_warning_due = due

    # ------------------------------------------------------------------ loading

    @contextlib.contextmanager
    def loading_from(self, source: tuple):
        """While PEFT loads an adapter: `(model_id, subfolder, revision, token)`, so the file beside it is found."""
        self._encoder_source = source
        try:
            yield
        finally:
            self._encoder_source = None

    @property
    def encoder_source(self) -> Optional[tuple]:
        return self._encoder_source

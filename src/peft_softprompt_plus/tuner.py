"""`SoftPromptPlusModel`: the PEFT tuner that owns the prompted forward, `generate`, adapters and (de)serialization.

PEFT calls into it as it would into LoRA; the prompt itself lives in a `SoftPromptBank` beside the untouched base.
"""

from __future__ import annotations

from typing import Optional

import torch
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer, delete_adapter, set_adapter, set_requires_grad
from peft.utils import set_additional_trainable_modules
from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper
from torch import nn

from . import attention, forward_paths, generation, gradient_flow, semantics, tying
from ._peft_registry import PREFIX
from .config import ForwardPath, SoftPromptPlusConfig
from .prompt_bank import SoftPromptBank
from .prompt_init import initial_prompt
from .tasks import TASKS

_BANK = "softprompt_plus"
_SAVED_KEY = f"{_BANK}.prompt"


def _task_name(config: SoftPromptPlusConfig) -> str:
    task = config.task_type or "CAUSAL_LM"
    return str(getattr(task, "value", task))


def _checkpointing(model: nn.Module) -> bool:
    # transformers 5 renamed the flag; the old name still works but warns.
    flag = getattr(type(model), "is_activation_checkpointing", None)
    name = "is_activation_checkpointing" if flag is not None else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def _input_to_own_dtype(module: nn.Module, args: tuple) -> tuple:
    dtype = next(module.parameters()).dtype  # read per call: `.half()` after attach lowers the module again
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def _lift_to_float32(module: nn.Module) -> None:
    """Float32 weights for a trainable copy fed by a low-precision base; it casts its own input. Idempotent."""
    for param in module.parameters():
        if param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.float()
    if not getattr(module, "_softprompt_plus_casts_input", False):
        module.register_forward_pre_hook(_input_to_own_dtype)
        module._softprompt_plus_casts_input = True


class SoftPromptPlusModel(BaseTuner):
    """Tuner for `SoftPromptPlusConfig`. Users reach it through `get_peft_model`; see the package README."""

    prefix: str = PREFIX
    tuner_layer_cls = SoftPromptBank
    target_module_mapping: dict = {}

    # ------------------------------------------------------------------ attach

    def inject_adapter(
        self,
        model: nn.Module,
        adapter_name: str,
        autocast_adapter_dtype: bool = True,
        low_cpu_mem_usage: bool = False,
        state_dict: Optional[dict] = None,
    ) -> None:
        config = self.peft_config[adapter_name]
        task = TASKS[_task_name(config)]
        self._check_model(model, config, task)
        tying.refuse_tied_training(model, config.modules_to_save)
        if _BANK not in self._modules:
            # Recorded once, so `unload()` can hand back the base model exactly as it came.
            self._base_requires_grad = {n: p.requires_grad for n, p in model.named_parameters()}
            self._base_loss_type = getattr(model, "loss_type", None)
            task.on_attach(model)
            model.requires_grad_(False)
            self.softprompt_plus = SoftPromptBank()
            self._kv_store = generation.PromptKVStore()
            self._pending_validation: set[str] = set()
            self._own_attention = attention.install(model)
            self._attention_path = forward_paths.attention_supported(model)
            if not self._attention_path:
                attention.uninstall(model, self._own_attention)
                attention.log_once(
                    f"{type(model).__name__} computes attention outside transformers' attention registry: its soft "
                    "prompt is concatenated to every row (forward_path='concat')."
                )
        trainable = adapter_name in self.active_adapters and not config.inference_mode
        try:
            values = initial_prompt(config, model.get_input_embeddings(), model.config)
            self.softprompt_plus.add(adapter_name, values.to(model.get_input_embeddings().weight.device), trainable)
            self.softprompt_plus._active_adapter = list(self.active_adapters)
            set_additional_trainable_modules(
                model=model,
                peft_config=config,
                model_config=BaseTuner.get_model_config(self),
                adapter_name=adapter_name,
                activate_adapter=adapter_name in self.active_adapters,
            )
            # Inactive adapters (add_adapter) are probed too: validate_at_attach activates them for the probe.
            if not config.inference_mode and config.validate_gradients != "off":
                self._pending_validation.add(adapter_name)
                self._validate_pending()
        except Exception:
            self._roll_back(model, adapter_name)
            raise

    def _roll_back(self, model: nn.Module, adapter_name: str) -> None:
        """A failed attach leaves the base as it came: no half-added prompt, original `requires_grad` flags."""
        if adapter_name in self.softprompt_plus.prompt:
            del self.softprompt_plus.prompt[adapter_name]
        if not self.softprompt_plus.prompt:
            attention.uninstall(model, self._own_attention)
            for name, param in model.named_parameters():
                param.requires_grad_(self._base_requires_grad.get(name, param.requires_grad))

    def _abandon_load(self, adapter_name: str) -> None:
        """A load that can't fit drops the adapter it just added, so the base model is handed back as it came."""
        self._pending_validation.discard(adapter_name)
        self._roll_back(self.model, adapter_name)
        self.peft_config.pop(adapter_name, None)

    @staticmethod
    def _check_model(model: nn.Module, config: SoftPromptPlusConfig, task) -> None:
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if not isinstance(embedding, nn.Embedding):
            raise ValueError(
                f"SoftPromptPlusConfig needs a model whose `get_input_embeddings()` is an nn.Embedding, got "
                f"{type(model).__name__} with {type(embedding).__name__}. Use a GPT-2-style transformers model."
            )
        if not hasattr(model, task.needs):
            raise ValueError(
                f"`task_type`={_task_name(config)!r} needs a model with `.{task.needs}`, got {type(model).__name__}. "
                "Use AutoModelForCausalLM for CAUSAL_LM and AutoModelForSequenceClassification for SEQ_CLS."
            )

    def _create_and_replace(self, *args, **kwargs):  # BaseTuner's abstract hook; nothing is replaced
        raise NotImplementedError("SoftPromptPlusModel injects no layers into the base model.")

    def _prepare_adapter_config(self, peft_config, model_config):
        return peft_config

    def _validate_pending(self) -> None:
        """Run the attach-time gradient probe for adapters whose prompt holds real values.

        With `low_cpu_mem_usage=True` PEFT creates the prompt on the meta device and fills it later; PEFT calls
        `_cast_adapter_dtype` right after loading, which is where such a deferred probe runs.
        """
        for name in sorted(self._pending_validation):
            if self.softprompt_plus.prompt[name].is_meta:
                continue
            self._pending_validation.discard(name)
            try:
                gradient_flow.validate_at_attach(self, name, self.peft_config[name].validate_gradients)
            except Exception:
                self._roll_back(self.model, name)
                raise

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        # The bank keeps prompts float32 by itself. A `modules_to_save` copy (the SEQ_CLS `score` head) starts in the
        # base dtype, and GradScaler refuses fp16 gradients: lift it to float32 as PEFT lifts LoRA weights. PEFT
        # calls this after attaching and after loading; the probe then sees the dtypes training will see.
        if autocast_adapter_dtype:
            for wrapper in self.model.modules():
                if isinstance(wrapper, ModulesToSaveWrapper) and adapter_name in wrapper.modules_to_save:
                    _lift_to_float32(wrapper.modules_to_save[adapter_name])
        self._validate_pending()

    # ------------------------------------------------------------------ adapters

    def _check_new_adapter_config(self, config) -> None:
        return None

    def set_adapter(self, adapter_name, inference_mode: bool = False) -> None:
        set_adapter(self, adapter_name, inference_mode=inference_mode, layer_cls=SoftPromptBank)
        self.active_adapter = adapter_name

    def delete_adapter(self, adapter_name: str) -> None:
        if adapter_name not in self.peft_config:
            raise ValueError(f"`adapter_name`={adapter_name!r} does not exist; adapters: {list(self.peft_config)}.")
        del self.peft_config[adapter_name]
        self._kv_store.drop(adapter_name)
        new_active = delete_adapter(self, adapter_name=adapter_name, prefix=self.prefix, layer_cls=SoftPromptBank)
        self.active_adapter = new_active or []

    def set_requires_grad(self, adapter_names, requires_grad: bool = True) -> None:
        set_requires_grad(self, adapter_names=adapter_names, requires_grad=requires_grad)

    def _enable_adapter_layers(self, enabled: bool = True) -> None:
        # A disabled adapter hands the model its own attention setting back, as `unload()` does.
        if not enabled:
            attention.uninstall(self.model, self._own_attention)
        elif self._attention_path:
            self._own_attention = attention.install(self.model)
        for module in self.modules():
            if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
                module.enable_adapters(enabled)

    def _check_merge_allowed(self):
        self.softprompt_plus.merge()

    def merge_adapter(self, *args, **kwargs) -> None:
        self.softprompt_plus.merge()

    def unload(self) -> nn.Module:
        """Return the base model exactly as it came: same objects, same weights, same `requires_grad` flags."""
        model = self._unload_and_optionally_merge(merge=False)
        attention.uninstall(model, self._own_attention)
        if hasattr(model, "loss_type"):
            model.loss_type = self._base_loss_type
        for name, param in model.named_parameters():
            param.requires_grad_(self._base_requires_grad.get(name, param.requires_grad))
        return model

    # ------------------------------------------------------------------ forward

    def _active(self) -> Optional[str]:
        if self.softprompt_plus.disable_adapters or not self.active_adapters:
            return None
        if len(self.active_adapters) > 1:
            raise ValueError(
                f"Only one soft prompt can be active at a time, got active adapters {self.active_adapters}. "
                "Call `model.set_adapter(name)`."
            )
        return self.active_adapters[0]

    def prompt(self, adapter_name: Optional[str] = None) -> nn.Parameter:
        """The float32 `[N, D]` prompt of `adapter_name` (default: the active adapter): the leaf to optimize."""
        name = adapter_name if adapter_name is not None else self.active_adapters[0]
        if name not in self.softprompt_plus.prompt:
            raise ValueError(f"`adapter_name`={name!r} does not exist; adapters: {list(self.softprompt_plus.prompt)}.")
        return self.softprompt_plus.prompt[name]

    def prompt_for_use(self, adapter_name: str) -> torch.Tensor:
        """The float32 leaf cast to the embedding's dtype/device at the point of use: its gradient stays float32."""
        weight = self.model.get_input_embeddings().weight
        return self.softprompt_plus.prompt[adapter_name].to(device=weight.device, dtype=weight.dtype)  # [N, D]

    def _uses_attention(self, config: SoftPromptPlusConfig) -> bool:
        """The attention path unless asked for concatenation or the family can't take it."""
        path = config.forward_path
        if path == ForwardPath.SHARED_KV.value and not self._attention_path:
            raise ValueError(
                f"`forward_path='shared_kv'` needs a model whose attention runs through transformers' attention "
                f"registry; {type(self.model).__name__} computes its own. Use `forward_path='auto'` or 'concat'."
            )
        if path == ForwardPath.CONCAT.value or not self._attention_path:
            return False
        if not attention.is_installed(self.model.config):  # `set_attn_implementation` since attaching
            self._own_attention = attention.install(self.model)
        return True

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None, **kwargs):
        adapter = self._active()
        if adapter is None:
            return self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                inputs_embeds=inputs_embeds,
                labels=labels,
                **kwargs,
            )
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError(
                "Pass exactly one of `input_ids` and `inputs_embeds` to a soft-prompted model, got "
                f"input_ids={'a tensor' if input_ids is not None else None}, "
                f"inputs_embeds={'a tensor' if inputs_embeds is not None else None}."
            )
        for key in ("cache", "past_key_values", "position_ids"):
            if kwargs.get(key) is not None:
                raise ValueError(
                    f"`{key}` can't be passed to a soft-prompted forward, got a {type(kwargs[key]).__name__}: the "
                    "prompt owns positions 0..N-1 and the cache. Positions come from `attention_mask`; for "
                    "incremental decoding use `model.generate()`; with TRL, turn off `packing` and `padding_free` "
                    "(one prompt can't sit in front of each packed document)."
                )
        if self.training and not torch.is_grad_enabled():
            gradient_flow.warn_grad_disabled_once(self)
        config = self.peft_config[adapter]
        task = TASKS[_task_name(config)]
        prompt = self.prompt_for_use(adapter)  # [N, D]
        text = input_ids if input_ids is not None else inputs_embeds
        semantics.check_fits(prompt.shape[0], text.shape[1], semantics.max_positions(self.model.config))
        rows = forward_paths.RowPrompts([prompt])
        if self._uses_attention(config):
            riding = task.riding_when_shared(self.model, labels, kwargs)
            batch = forward_paths.build_attention(self.model, rows, riding, input_ids, inputs_embeds, attention_mask)
        else:
            batch = forward_paths.build_concat(self.model, rows, input_ids, inputs_embeds, attention_mask)
        return task.run(self.model, batch, labels, kwargs)

    def generate(self, *args, **kwargs):
        adapter = self._active()
        if adapter is None:
            return self.model.generate(*args, **kwargs)
        prompt = self.prompt_for_use(adapter)  # [N, D]
        if not self._uses_attention(self.peft_config[adapter]):
            return generation.generate_concat(self.model, prompt, args, kwargs)
        param = self.softprompt_plus.prompt[adapter]
        prompt_kv = self._kv_store.get(adapter, param, self.model, prompt)
        return generation.generate(self.model, prompt_kv, args, kwargs)

    # ------------------------------------------------------------------ (de)serialization hooks

    @classmethod
    def _get_adapter_state_dict(cls, model, config, adapter_name, state_dict, unwanted_adapter_names):
        suffix = f"{_SAVED_KEY}.{adapter_name}"
        return {k: v.detach().to(torch.float32).contiguous() for k, v in state_dict.items() if k.endswith(suffix)}

    @classmethod
    def _remap_adapter_state_dict_for_load(cls, model, config, adapter_name, state_dict):
        bank_name, bank = next((n, m) for n, m in model.named_modules() if isinstance(m, SoftPromptBank))
        tuner = next(m for m in model.modules() if isinstance(m, SoftPromptPlusModel))
        saved = [k for k in state_dict if k.endswith(_SAVED_KEY)]
        if not saved:
            tuner._abandon_load(adapter_name)
            raise ValueError(
                f"The adapter weights hold no soft prompt (no key ending in {_SAVED_KEY!r}; found "
                f"{sorted(state_dict)[:5]}). This is not a softprompt-plus adapter, or the file is damaged."
            )
        expected = bank.prompt[adapter_name].shape
        remapped = {k: v for k, v in state_dict.items() if k not in saved}
        for key in saved:
            value = state_dict[key]
            if value.shape != expected:
                tuner._abandon_load(adapter_name)
                raise ValueError(
                    f"The saved prompt has shape {list(value.shape)} = [num_virtual_tokens, hidden size], but this "
                    f"base model needs {list(expected)}: the adapter was trained on a model with hidden size "
                    f"{value.shape[-1]}, this one has {expected[-1]}. Load it into the base model it was trained on."
                )
            remapped[f"{bank_name}.prompt.{adapter_name}"] = value
        return remapped

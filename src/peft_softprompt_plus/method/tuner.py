"""`SoftPromptPlusModel`: the PEFT tuner that owns the prompted forward, `generate`, adapters and (de)serialization.

PEFT calls into it as it would into LoRA; the prompt itself lives in a `SoftPromptBank` beside the untouched base.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer, delete_adapter, set_adapter, set_requires_grad
from peft.utils import set_additional_trainable_modules
from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper
from torch import nn

from .._names import (
    BANK,
    ORIGINS,
    PREFIX,
    SAVED_KEY,
    SAVED_KV_KEY,
    SAVED_ORIGINS_KEY,
    SINKS,
    encoder_state,
    prompt_key,
)
from ..files import loading, saving
from ..forward import paths as forward_paths
from ..forward import prompted, routing, validation
from ..forward.state import ForwardState
from ..gradients import flow as gradient_flow
from . import kv_init, placement, precision, reparam, tying
from .config import ForwardPath, PromptLevel
from .prompt_bank import LegacyBankView, SoftPromptBank, legacy_view
from .prompt_init import initial_prompt, placeholder
from .tasks import count_label_zero, task_of


class SoftPromptPlusModel(BaseTuner):
    """Tuner for `SoftPromptPlusConfig`. Users reach it through `get_peft_model`; see the package README."""

    prefix: str = PREFIX

    def __init__(self, model: nn.Module, peft_config, adapter_name: str = "default", **kwargs) -> None:
        if not isinstance(peft_config, dict):  # PeftModel hands {name: config}; inject_adapter_in_model a bare config
            raise ValueError(
                "`inject_adapter_in_model` can't attach a SoftPromptPlusConfig: a soft prompt is an input, not a "
                "layer injected into the model, and it needs the PeftModel that owns forward and generate. Use "
                "`peft.get_peft_model(model, config)`; the model was left untouched."
            )
        super().__init__(model, peft_config, adapter_name, **kwargs)

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
        task = task_of(config.task_type)
        validation.check_attach(model, config, task)
        tying.refuse_tied_training(model, config.modules_to_save)
        if BANK not in self._modules:
            # Created once, so `unload()` can hand back the base model exactly as it came.
            self.forward_state = ForwardState(model)
            self.prompt_bank = SoftPromptBank()
            self._pending_validation: set[str] = set()
        if not self.prompt_bank.prompts:  # the first adapter, or the first since the last one was deleted
            self.forward_state.start(model, task)
        trainable = adapter_name in self.active_adapters and not config.inference_mode
        try:
            if config.forward_path == ForwardPath.SHARED_KV and not self.forward_state.attention_path:
                raise forward_paths.shared_kv_refused(model, forward_paths.OUTSIDE_REGISTRY)
            embedding = model.get_input_embeddings()
            if config.prompt_level == PromptLevel.KV:
                self.forward_state.without_flash(model)
                state = self.forward_state
                values, origins = kv_init.starting_values(
                    config, model, state.kv_layout, loading.is_loading(), state.attention
                )
            else:
                placement.resolve(config, embedding)  # the hard prefix/suffix as ids, stored in the config
                prefix, suffix = placement.hard_ids(config)
                validation.check_placed_room(model, len(prefix), config.num_virtual_tokens, len(suffix))
                # A load overwrites the values: they need no tokenizer, no source folder.
                values = (placeholder if loading.is_loading() else initial_prompt)(config, embedding, model.config)
                origins = None
            # An inference-mode adapter is a folded table (what save_pretrained writes): it needs no encoder.
            encoder = None if config.inference_mode else reparam.encoder_for(config, embedding)
            frozen = config.kv_frozen_positions or 0
            self.prompt_bank.add(adapter_name, values.to(embedding.weight.device), trainable, encoder, frozen, origins)
            self.prompt_bank._active_adapter = list(self.active_adapters)
            count_label_zero(model, [self.peft_config[n] for n in self.active_adapters if n in self.peft_config])
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
        """A failed attach leaves the base as it was: no half-added prompt, the `requires_grad` flags it had."""
        self.prompt_bank.drop(adapter_name)
        if not self.prompt_bank.prompts:
            self.forward_state.roll_back(model)

    def _abandon_load(self, adapter_name: str) -> None:
        """A load that can't fit drops the adapter it just added, so the base model is handed back as it came."""
        self._pending_validation.discard(adapter_name)
        self._roll_back(self.model, adapter_name)
        self.peft_config.pop(adapter_name, None)

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
            if self.prompt_bank.prompts[name].is_meta:
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
                    precision.lift_to_float32(wrapper.modules_to_save[adapter_name])
        self._validate_pending()

    # ------------------------------------------------------------------ adapters

    def _check_new_adapter_config(self, config) -> None:
        return None

    def set_adapter(self, adapter_name, inference_mode: bool = False) -> None:
        """One adapter, or a list of KV adapters read composed by every row (each trains, unless `inference_mode`)."""
        if not isinstance(adapter_name, str):
            entry = routing.composition(
                list(adapter_name), list(self.peft_config), self.kv_adapter_names(), "`set_adapter`"
            )
            adapter_name = list(routing.names_of(entry))
        set_adapter(self, adapter_name, inference_mode=inference_mode, layer_cls=SoftPromptBank)
        self.active_adapter = adapter_name
        count_label_zero(self.model, [self.peft_config[n] for n in self.active_adapters])

    def delete_adapter(self, adapter_name: str) -> None:
        routing.check_adapter_name(adapter_name, list(self.peft_config), "delete_adapter")
        del self.peft_config[adapter_name]
        self.forward_state.kv_store.drop(adapter_name)
        new_active = delete_adapter(self, adapter_name=adapter_name, prefix=self.prefix, layer_cls=SoftPromptBank)
        self.active_adapter = new_active or []
        if not self.prompt_bank.prompts:  # PEFT's convention: without adapters the model is the base model
            self.forward_state.stop(self.model)

    def set_requires_grad(self, adapter_names, requires_grad: bool = True) -> None:
        set_requires_grad(self, adapter_names=adapter_names, requires_grad=requires_grad)

    def _enable_adapter_layers(self, enabled: bool = True) -> None:
        # A disabled adapter hands the model its own attention setting back, as `unload()` does.
        if not enabled:
            self.forward_state.pause_attention(self.model)
        elif self.prompt_bank.prompts:
            self.forward_state.ensure_attention(self.model)
        for module in self.modules():
            if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
                module.enable_adapters(enabled)

    def _check_merge_allowed(self):
        self.prompt_bank.merge()

    def merge_adapter(self, *args, **kwargs) -> None:
        self.prompt_bank.merge()

    def unload(self) -> nn.Module:
        """Return the base model exactly as it came: same objects, same weights, same `requires_grad` flags."""
        model = self._unload_and_optionally_merge(merge=False)
        self.forward_state.unload(model)
        return model

    # ------------------------------------------------------------------ forward

    def active_entry(self) -> Optional[routing.Entry]:
        """The active adapter's name, a tuple of composed KV adapters, or None (disabled, or none active)."""
        if self.prompt_bank.disable_adapters or not self.active_adapters:
            return None
        if len(self.active_adapters) > 1 and not set(self.active_adapters) <= set(self.kv_adapter_names()):
            raise ValueError(
                f"Only one soft prompt can be active at a time, got active adapters {self.active_adapters}; only KV "
                "adapters compose. Call `model.set_adapter(name)`."
            )
        active = tuple(self.active_adapters)
        return active if len(active) > 1 else active[0]

    def kv_adapter_names(self) -> list[str]:
        """The names of this model's KV adapters (the ones that compose)."""
        return [name for name, config in self.peft_config.items() if config.prompt_level == PromptLevel.KV]

    def is_kv(self, entry: routing.Entry) -> bool:
        """Whether `entry` (an adapter name, or a composition of KV adapters) reads keys/values, not input vectors."""
        return self.peft_config[routing.names_of(entry)[0]].prompt_level == PromptLevel.KV

    def text_start(self, entry: routing.Entry) -> int:
        """The position the text takes after `entry`'s prompt: P+N+S for an input prompt, a KV prompt's recorded
        `kv_text_start`, the sum of a composition's (each cache keeps its own positions)."""
        configs = [self.peft_config[name] for name in routing.names_of(entry)]  # `kv_text_start` is filled at attach
        return sum(c.kv_text_start for c in configs) if self.is_kv(entry) else placement.length(configs[0])

    def prompt(self, adapter_name: Optional[str] = None) -> nn.Parameter:
        """The float32 prompt of `adapter_name` (default: the active adapter), the leaf to optimize: `[N, D]` (with
        `reparameterization='residual'`, the raw prompt its encoder reads; the encoder trains too), or a KV prompt's
        trained `[layers, 2, Hkv, N - kv_frozen_positions, hd]` keys/values."""
        name = adapter_name if adapter_name is not None else next(iter(self.active_adapters), None)
        if not isinstance(name, str) or name not in self.prompt_bank.prompts:
            raise routing.unknown_adapter(name, list(self.prompt_bank.prompts), "prompt")
        return self.prompt_bank.prompts[name]

    @property
    def softprompt_plus(self) -> LegacyBankView:
        """Deprecated since 0.2 and removed in 0.4.0: `softprompt_plus.prompt[name]` is `prompt(name)`."""
        return legacy_view(self.prompt_bank)

    def prompt_for_use(self, adapter_name: routing.Entry) -> torch.Tensor:
        """The prompt the model reads, cast to the embedding's dtype/device at the point of use, so the gradient of
        the float32 leaf stays float32. An input prompt: its hard prefix, the soft rows (the leaf, or its encoder's
        output) and its hard suffix, `[P+N+S, D]`. A KV prompt: its keys/values `[layers, 2, Hkv, N, hd]`; a
        composition's concatenated in order along the positions."""
        embedding = self.model.get_input_embeddings()
        names = routing.names_of(adapter_name)
        values = [
            self.prompt_bank.values(n).to(device=embedding.weight.device, dtype=embedding.weight.dtype) for n in names
        ]
        if self.is_kv(adapter_name):
            return values[0] if len(values) == 1 else torch.cat(values, dim=-2)  # [layers, 2, Hkv, N, hd]
        return placement.around(values[0], embedding, self.peft_config[names[0]])  # [P+N+S, D]

    @contextlib.contextmanager
    def _enable_peft_forward_hooks(self, *args, **kwargs):
        # PeftModel hands `adapter_names` to this hook and strips it from what reaches `forward`/`generate`.
        with self.forward_state.routing(kwargs.get("adapter_names")):
            yield

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None, adapter_names=None, **kw):
        return prompted.forward(self, input_ids, attention_mask, inputs_embeds, labels, adapter_names, kw)

    def generate(self, *args, adapter_names=None, **kwargs):
        return prompted.generate(self, args, adapter_names, kwargs)

    # ------------------------------------------------------------------ (de)serialization hooks

    @classmethod
    def _get_adapter_state_dict(cls, model, config, adapter_name, state_dict, unwanted_adapter_names):
        found = next((v for k, v in state_dict.items() if k.endswith(prompt_key(adapter_name))), None)
        if found is None:
            return {}
        sink = next((v for k, v in state_dict.items() if k.endswith(prompt_key(adapter_name, table=SINKS))), None)
        frozen = config.kv_frozen_positions or 0
        prompt = saving.full_prompt(found, config.num_virtual_tokens - frozen, adapter_name)
        if sink is not None:  # a KV prompt's frozen leading positions, saved with the rest as one tensor
            prompt = torch.cat([saving.full_prompt(sink, frozen, adapter_name), prompt], dim=-2)
        encoder = encoder_state(state_dict, adapter_name)
        if encoder:  # the adapter is the folded table: loaders and serving engines see a plain prompt
            prompt = reparam.fold(prompt, encoder, config.residual_layer_norm)
        saved = {SAVED_KV_KEY if config.prompt_level == PromptLevel.KV else SAVED_KEY: prompt}
        origins = next((v for k, v in state_dict.items() if k.endswith(prompt_key(adapter_name, table=ORIGINS))), None)
        if origins is not None:  # a per-head KV prompt: where each entry came from, read back without a tokenizer
            saved[SAVED_ORIGINS_KEY] = origins.detach().to(torch.int64)
        return saved

    @classmethod
    def _remove_adapter_name_from_key(cls, key: str, adapter_name: str) -> str:
        # The saved prompt's key holds no adapter name; PEFT's default would cut one that ends it ("... .prompt").
        if key in (SAVED_KEY, SAVED_KV_KEY, SAVED_ORIGINS_KEY):
            return key
        return super()._remove_adapter_name_from_key(key, adapter_name)

    @classmethod
    def _remap_adapter_state_dict_for_load(cls, model, config, adapter_name, state_dict):
        bank_name = next(n for n, m in model.named_modules() if isinstance(m, SoftPromptBank))
        tuner = next(m for m in model.modules() if isinstance(m, SoftPromptPlusModel))
        try:
            return loading.remapped_for_load(tuner, bank_name, adapter_name, state_dict)
        except loading.AdapterFileError:
            tuner._abandon_load(adapter_name)
            raise

"""The method's names, in a leaf module every other one may import."""

METHOD = "SOFTPROMPT_PLUS"  # the PeftType member and `peft_type` in adapter_config.json
PREFIX = "softprompt_plus_"  # PEFT finds adapter parameters by this prefix in their names
BANK = "prompt_bank"  # the tuner's SoftPromptBank; its prompts: `base_model.prompt_bank.softprompt_plus_prompt.<name>`
SAVED_KEY = "base_model.softprompt_plus.prompt"  # the prompt's key in adapter_model.safetensors (every release)
KV_SINCE = "0.3.0"  # the first release that reads a KV prompt (`prompt_level="kv"`)
# A KV prompt's key. A release before KV_SINCE looks for SAVED_KEY only and lists the keys it found in its error, so
# the key itself names the release that reads it.
SAVED_KV_KEY = f"base_model.softprompt_plus.kv_prompt:requires peft-softprompt-plus>={KV_SINCE}"
PROMPTS = "softprompt_plus_prompt"  # the bank's ParameterDict of prompts (a KV prompt: its trained positions)
SINKS = "softprompt_plus_sink"  # the bank's ParameterDict of a KV prompt's frozen leading positions
ORIGINS = "softprompt_plus_origin"  # the bank's ParameterDict of a per-head KV prompt's entries' context positions
# A per-head KV prompt's origins in adapter_model.safetensors: `[layers, Hkv, N]` int64 context positions.
SAVED_ORIGINS_KEY = "base_model.softprompt_plus.kv_origins"


def prompt_key(adapter_name: str, bank: str = BANK, table: str = PROMPTS) -> str:
    """An adapter's prompt in a live model's state dict (`bank` the bank's path in it; its name alone as a suffix);
    `table=SINKS` for a KV prompt's frozen positions."""
    return f"{bank}.{table}.{adapter_name}"


BASE_ROW = "__base__"  # `adapter_names` entry for a row without a prompt (PEFT's convention)
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
ENCODER_FILE = "adapter_encoder.safetensors"  # a residual adapter's raw prompt + encoder, read only to resume training
RAW_KEY = "prompt"  # the raw (unfolded) prompt's key in ENCODER_FILE; the encoder's are `encoder.<name>`


def encoder_state(state_dict: dict, adapter_name: str) -> dict:
    """An adapter's encoder tensors in a model state dict, by the encoder's own names (`down.weight`, ...)."""
    marker = f"{BANK}.softprompt_plus_encoder.{adapter_name}."
    return {k.split(marker, 1)[1]: v for k, v in state_dict.items() if marker in k}


# KV prompts served by vLLM (serve/share.py publishes, integrations/vllm_kv.py reads in vLLM's processes).
VLLM_KV_PARAM = "softprompt_plus_kv"  # a request's `kv_transfer_params` key: the KV prompt's content hash
VLLM_KV_SERVED = "softprompt_plus_kv_served"  # the connector's mark in a finished request's `kv_transfer_params`
VLLM_KV_REFUSED = "softprompt_plus_kv_refused"  # the connector's reason, where it did not apply the KV prompt
VLLM_KV_TENSOR = "kv_prompt"  # the tensor's name in a published `<hash>.safetensors`

"""The prompt for serving engines that take embeddings instead of token ids (vLLM's `prompt_embeds`, SGLang's
`input_embeds`): one `[N+L, D]` sequence per row, `[prompt; embed(text)]`, that the unchanged base model turns into
this library's logits. See docs/serving.md for the engines' calls and what was tested."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from ..forward import routing, semantics, validation
from ..method import placement
from ..method.errors import not_ours
from ..method.tasks import task_name, task_of
from ..method.tuner import SoftPromptPlusModel


def _tuner_of(model) -> SoftPromptPlusModel:
    """The tuner behind a PeftModel (`model.base_model`), or the tuner itself."""
    if isinstance(model, SoftPromptPlusModel):
        return model
    inner = getattr(model, "base_model", None) if isinstance(model, nn.Module) else None
    if isinstance(inner, SoftPromptPlusModel):
        return inner
    raise not_ours(model)


def _adapter(tuner: SoftPromptPlusModel, adapter_name) -> str:
    """`adapter_name`, or the one active adapter; an adapter an embeddings-only engine can run."""
    known = list(tuner.prompt_bank.prompts)
    if adapter_name is None:
        active = list(tuner.active_adapters)
        if len(active) != 1:
            raise ValueError(
                f"`adapter_name` is needed: the model has {len(active)} active adapters {active}. Pass one of {known}."
            )
        adapter_name = active[0]
    if not isinstance(adapter_name, str):
        raise ValueError(
            f"`adapter_name` must be one adapter name (str), got {type(adapter_name).__name__} {adapter_name!r}. "
            "Call once per adapter: an engine request reads one prompt."
        )
    if adapter_name not in known:
        raise routing.unknown_adapter(adapter_name, known, "prompt_embeds")
    config = tuner.peft_config[adapter_name]
    if not task_of(config.task_type).served_by_engines:
        raise ValueError(
            f"`adapter_name`={adapter_name!r} is a {task_name(config.task_type)} adapter: its trained head scores "
            "the model's output, and an engine fed embeddings runs the base model's own head. Serve it with this "
            "library (`model(input_ids=..., attention_mask=...)`)."
        )
    if config.prompt_level == "kv":
        raise ValueError(
            f"`adapter_name`={adapter_name!r} is a KV prompt (prompt_level='kv'): every layer's keys and values, "
            "while an engine fed embeddings computes each layer's keys itself from what it is given, so no embeddings "
            "sequence reproduces it. Serve it with this library (`model.generate`, or `model(...)` per request); "
            "`softprompt-plus serve` refuses KV adapters (vLLM would need a KV connector to take them)."
        )
    if config.modules_to_save:
        raise ValueError(
            f"`adapter_name`={adapter_name!r} also trains `modules_to_save`={list(config.modules_to_save)}: those "
            "weights run inside the model, and an engine fed embeddings runs the base model's. Serve it with this "
            "library, or train an adapter without modules_to_save."
        )
    return adapter_name


def _rows(input_ids, attention_mask, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_ids` and `attention_mask` as `[B, L]`, checked; a 1-D input is one row."""
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() not in (1, 2):
        raise ValueError(
            f"`input_ids` must be [L] (one row) or [B, L], got shape {list(input_ids.shape)}. Drop the extra "
            "dimensions."
        )
    one_row = isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1
    ids = validation.check_ids("input_ids", input_ids.unsqueeze(0) if one_row else input_ids, vocab)
    if attention_mask is None:
        return ids, torch.ones_like(ids)
    if one_row and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 1:
        attention_mask = attention_mask.unsqueeze(0)
    validation.check_mask(attention_mask, ids.shape[0], ids.shape[1])
    return ids, attention_mask


def _check_fits(mask: torch.Tensor, num_prompt: int, limit: Optional[int]) -> None:
    real = mask.bool().sum(dim=1)  # [B]
    longest = int(real.max())
    if limit is not None and num_prompt + longest > limit:
        row = int(real.argmax())
        raise ValueError(
            f"`input_ids` row {row} has {longest} real tokens: with the prompt (num_virtual_tokens N={num_prompt}) "
            f"that is {num_prompt + longest} positions, but the model has {limit}. Truncate the text to at most "
            f"{limit - num_prompt} tokens."
        )


def _embed_scale(embedding: nn.Module) -> torch.Tensor:
    """The factor transformers' embedding module multiplies its rows by (Gemma's sqrt(hidden size)); 1 for most."""
    return torch.as_tensor(getattr(embedding, "embed_scale", 1.0), dtype=torch.float32).detach().cpu()


def prompt_embeds(
    model,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    adapter_name: Optional[str] = None,
    as_list: bool = False,
    engine_scales_embeddings: bool = False,
) -> Union[list[torch.Tensor], list[list[list[float]]]]:
    """Each row's `[N+L_b, D]` embeddings sequence `[prompt; embed(real tokens of row b)]` for an engine that takes
    embeddings: the base model fed one as `inputs_embeds`, at positions `0..N+L_b-1`, computes this library's
    logits for that row.

    - `model`: a PeftModel with a SOFTPROMPT_PLUS adapter, or its tuner (`model.base_model`).
    - `input_ids`: `[B, L]` token ids, or `[L]` for one row. `attention_mask`: its 0/1 mask; padding (left or right)
      is dropped, so `L_b` is row b's number of real tokens.
    - `adapter_name`: whose prompt (default: the active adapter). `CAUSAL_LM` adapters without `modules_to_save`
      only: an engine fed embeddings runs the base model's own layers and head.
    - `as_list`: return nested lists of Python floats (SGLang's JSON `input_embeds`) instead of tensors.
    - `engine_scales_embeddings`: for an engine that multiplies input embeddings by the model's embedding scale
      itself, return the sequence divided by that scale: the prompt over it and the raw embedding rows. With the
      default the sequence is what transformers' `inputs_embeds` takes (transformers 5 scales inside the embedding
      module), which is what vLLM 0.32 takes too (measured on Gemma, Gemma-2 and Gemma-3; docs/serving.md). No
      effect on models without a scale.

    Tensors are in the input embedding's dtype, on its device, without autograd: the float32 prompt is cast as this
    library's own forward casts it (`prompt_for_use`). Call `.cpu()` before `torch.save` for vLLM's server.
    """
    for flag, value in (("as_list", as_list), ("engine_scales_embeddings", engine_scales_embeddings)):
        if not isinstance(value, bool):
            raise ValueError(f"`{flag}` must be True or False, got {type(value).__name__} {value!r}.")
    tuner = _tuner_of(model)
    name = _adapter(tuner, adapter_name)
    embedding = tuner.model.get_input_embeddings()
    ids, mask = _rows(input_ids, attention_mask, embedding.num_embeddings)
    bos = getattr(tuner.model.config, "bos_token_id", None)
    placement.refuse_second_bos(tuner.peft_config, [name], None, ids, mask, bos)  # as the forward refuses it
    prompt = _block(tuner, name, engine_scales_embeddings)  # [P+N+S, D]
    _check_fits(mask, prompt.shape[0], semantics.max_positions(tuner.model.config))
    text = text_embeddings(embedding, ids, engine_scales_embeddings)  # [B, L, D]
    keep = mask.to(text.device).bool()  # [B, L]
    rows = [torch.cat([prompt, text[b][keep[b]]]) for b in range(text.shape[0])]  # each [N+L_b, D]
    return [row.tolist() for row in rows] if as_list else rows


def prompt_block(model, adapter_name: Optional[str] = None, engine_scales_embeddings: bool = False) -> torch.Tensor:
    """The `[P+N+S, D]` part every row of `prompt_embeds` starts with (hard prefix, soft rows, hard suffix), for a
    server that keeps it once per adapter and puts `text_embeddings` of each request after it. Same arguments and
    refusals as `prompt_embeds`."""
    if not isinstance(engine_scales_embeddings, bool):
        raise ValueError(
            f"`engine_scales_embeddings` must be True or False, got {type(engine_scales_embeddings).__name__} "
            f"{engine_scales_embeddings!r}."
        )
    tuner = _tuner_of(model)
    return _block(tuner, _adapter(tuner, adapter_name), engine_scales_embeddings)


def text_embeddings(embedding: nn.Module, ids: torch.Tensor, engine_scales_embeddings: bool = False) -> torch.Tensor:
    """`ids` `[..., L]` as the base's input embedding `embedding` gives them to the model (`[..., L, D]`), or as raw
    rows for an engine that scales them itself. Reads the weights only: safe from several threads."""
    with torch.no_grad():
        ids = ids.to(embedding.weight.device)
        if engine_scales_embeddings:
            return nn.functional.embedding(ids, embedding.weight, embedding.padding_idx)  # the raw rows
        return embedding(ids)  # as this library's forward embeds the text


def _block(tuner: SoftPromptPlusModel, name: str, engine_scales_embeddings: bool) -> torch.Tensor:
    # What this library's forward reads (a residual adapter's encoder output, not its raw leaf).
    prompt = tuner.prompt_for_use(name).detach()  # [P+N+S, D]
    if not engine_scales_embeddings:
        return prompt
    weight = tuner.model.get_input_embeddings().weight
    scale = _embed_scale(tuner.model.get_input_embeddings()).to(weight.device)
    return (prompt.float() / scale).to(weight.dtype)  # the engine multiplies it by the scale again

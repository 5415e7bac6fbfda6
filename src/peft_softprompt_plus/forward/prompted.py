"""The prompted `forward` and `generate` of the tuner: route each row to its prompt, check the inputs, pick the path
(the prompt at the attention, or concatenated), build the inputs and run the task."""

from __future__ import annotations

import torch
from peft.utils.other import ModulesToSaveWrapper

from ..gradients import flow as gradient_flow
from ..method import placement
from ..method.config import ForwardPath
from ..method.tasks import Task, task_name, task_of
from . import attention, generation, kv_pass, kv_regularize, routing, semantics, validation
from . import paths as forward_paths


def _on_gpu(model) -> bool:
    return model.get_input_embeddings().weight.is_cuda


def _configs(tuner, route: routing.Route) -> list:
    """The config of every adapter the route reads (a composition's each)."""
    return [tuner.peft_config[name] for entry in route.adapters for name in routing.names_of(entry)]


def _gpu_training_concatenates(tuner, route: routing.Route, paths: set, kw: dict, generating: bool) -> bool:
    """`forward_path='auto'` concatenates a GPU training step with one input prompt. Measured on an H200
    (bench/RESULTS.md): such a step is launch-bound, and the shared prompt pass runs every layer a second time, so ours
    took 1.3-2x PEFT's; one launch sequence over `[prompt; text]`, as PEFT runs it, is the faster exact form there. A
    training step is the model in training mode with gradients on; inference, `generate` (decided before transformers
    turns gradients off), mixed-adapter batches and KV prompts (no prompt pass to save) keep the attention path; so do
    sliding-window models, on which the concatenation counts a row's left padding, and `token_type_ids`, which only
    the attention path types."""
    config = tuner.model.config
    return (
        paths == {ForwardPath.AUTO.value}
        and not generating
        and route.rows is None
        and not tuner.is_kv(route.adapters[0])
        and tuner.model.training
        and torch.is_grad_enabled()
        and not getattr(config, "sliding_window", None)
        and kw.get("token_type_ids") is None
        and _on_gpu(tuner.model)
    )


def _uses_attention(tuner, route: routing.Route, kw: dict, generating: bool = False) -> bool:
    """The attention path unless a config asks for concatenation, the model can't take the prompt there, or a GPU
    training step is faster concatenated. A KV prompt never concatenates."""
    configs = _configs(tuner, route)
    paths = {c.forward_path for c in configs}
    state = tuner.forward_state
    sharded = state.attention_path and forward_paths.fsdp2_sharded(tuner.model)  # `fully_shard` runs after attach
    kv = any(tuner.is_kv(entry) for entry in route.adapters)
    if ForwardPath.SHARED_KV.value in paths and (sharded or not state.attention_path):
        reason = forward_paths.FSDP2_BLOCKS if sharded else forward_paths.OUTSIDE_REGISTRY
        raise forward_paths.shared_kv_refused(tuner.model, reason)
    if sharded and not kv:
        attention.log_once(
            "FSDP2 `fully_shard` wraps blocks of this model: the soft prompt is concatenated to every row "
            "(forward_path='concat')."
        )
    concat = ForwardPath.CONCAT.value in paths or not state.attention_path or (sharded and not kv)
    concat = concat or _gpu_training_concatenates(tuner, route, paths, kw, generating)
    routing.check_routable(route, concat)
    if not concat:
        state.ensure_attention(tuner.model)
    return not concat


def _route(tuner, adapter_names, text) -> routing.Route:
    names = adapter_names if adapter_names is not None else tuner.forward_state.adapter_names
    if names is not None and tuner.prompt_bank.disable_adapters:
        raise ValueError(
            f"`adapter_names`={names!r} was passed while the adapters are disabled (`disable_adapter()`). Leave "
            "the context to route rows to prompts, or use '__base__' rows for the base model."
        )
    batch = text.shape[0] if isinstance(text, torch.Tensor) and text.dim() else 0
    active = None if names is not None else tuner.active_entry()
    return routing.route_rows(names, active, batch, list(tuner.peft_config), tuner.kv_adapter_names())


def _task_for(tuner, route: routing.Route) -> Task:
    tasks = {task_name(c.task_type) for c in _configs(tuner, route)}
    if len(tasks) > 1:
        raise ValueError(
            f"`adapter_names` routes one batch to adapters of different task types {sorted(tasks)}; a batch runs "
            "one head. Route each task type in its own batch."
        )
    return task_of(tasks.pop())


def _names_for_heads(tuner, task: Task, adapter_names) -> list[str]:
    """Per-row names for the task head's copies; other `modules_to_save` copies can't follow a mixed batch."""
    names = list(adapter_names if adapter_names is not None else tuner.forward_state.adapter_names)
    composed = [n for n in names if not isinstance(n, str)]
    if composed and task.head_copies:
        raise ValueError(
            f"`adapter_names` composes KV adapters {list(composed[0])} in one row, but each adapter of this task "
            f"scores with a head of its own ({task.auto_class}), and a row runs one head. Compose causal-LM KV "
            "adapters only."
        )
    heads = [getattr(tuner.model, name) for name in task.head_copies if hasattr(tuner.model, name)]
    others = [
        n
        for n, m in tuner.model.named_modules()
        if isinstance(m, ModulesToSaveWrapper) and not any(m is h for h in heads)
    ]
    if others:
        raise ValueError(
            f"`adapter_names` mixes adapters in one batch, but `modules_to_save` copies {others} run inside the "
            "model, where prompts and rows share a batch. Route each adapter in its own batch."
        )
    return names


def forward(tuner, input_ids, attention_mask, inputs_embeds, labels, adapter_names, kw: dict):
    text = input_ids if input_ids is not None else inputs_embeds
    demonstration_index = kw.pop("demonstration_index", None)  # leave-one-out's column (kv_regularize.py)
    route = _route(tuner, adapter_names, text)
    if not route.adapters:
        return tuner.model(
            input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, labels=labels, **kw
        )
    task = _task_for(tuner, route)
    validation.check_forward(tuner.model, input_ids, inputs_embeds, attention_mask, labels, kw, task.token_labels)
    _refuse_second_bos(tuner, route, input_ids, attention_mask)
    if tuner.model.training and not torch.is_grad_enabled() and tuner.forward_state.take_grad_warning():
        gradient_flow.warn_grad_disabled(tuner)
    names = None if route.rows is None else _names_for_heads(tuner, task, adapter_names)
    rows = _row_prompts(tuner, route, names)
    semantics.check_fits(max(rows.text_starts), text.shape[1], semantics.max_positions(tuner.model.config))
    if _uses_attention(tuner, route, kw):
        # A KV prompt has no last position to run with the text: only an input prompt's may.
        in_text = task.prompt_in_text(tuner.model, labels, kw) if not all(rows.kv) else 0
        # Inference reuses each adapter's stored prompt pass, as generate does: serving pays for the text alone.
        reuse = not (in_text or tuner.model.training or torch.is_grad_enabled())
        layout = tuner.forward_state.kv_layout

        def passes():
            return (
                _stored_passes(tuner, route, rows)
                if reuse
                else kv_pass.prompt_passes(tuner.model, rows, in_text, layout)
            )

        batch = forward_paths.attention_inputs(
            tuner.model, rows, in_text, input_ids, inputs_embeds, attention_mask, passes
        )
        prompt_kv = batch.kwargs.get(attention.KWARG)
        if prompt_kv is not None:
            prompt_kv.keep = kv_regularize.row_keep(
                tuner, route, input_ids, attention_mask, demonstration_index, prompt_kv.max_length, text.shape[0]
            )
    else:
        if kw.get("token_type_ids") is not None:
            raise ValueError(
                "`token_type_ids` needs the prompt at the attention (it types the text's tokens, and a prompt "
                "position has no type); this model runs forward_path='concat'. Fold the type embeddings into "
                "`inputs_embeds`, or use forward_path='auto' on a model whose attention can take the prompt."
            )
        batch = forward_paths.concat_inputs(tuner.model, rows, input_ids, inputs_embeds, attention_mask)
    out = task.run(tuner.model, batch, labels, kw)
    tuner.forward_state.record_kernels(batch.kwargs.get(attention.KWARG))
    return out


def generate(tuner, args: tuple, adapter_names, kwargs: dict):
    route = _route(tuner, adapter_names, args[0] if args else kwargs.get("input_ids"))
    if not route.adapters:
        return tuner.model.generate(*args, **kwargs)
    _task_for(tuner, route)
    _refuse_second_bos(tuner, route, args[0] if args else kwargs.get("input_ids"), kwargs.get("attention_mask"))
    if not _uses_attention(tuner, route, kwargs, generating=True):
        return generation.generate_concat(tuner.model, tuner.prompt_for_use(route.adapters[0]), args, kwargs)
    prompt_kv, _ = _stored_passes(tuner, route, _row_prompts(tuner, route))
    return generation.generate(tuner.model, prompt_kv, args, kwargs)


def _row_prompts(tuner, route: routing.Route, names=None) -> forward_paths.RowPrompts:
    """Each entry's prompt as the model reads it, whether it is a KV prompt, and where its text starts."""
    return forward_paths.RowPrompts(
        [tuner.prompt_for_use(entry) for entry in route.adapters],
        route.rows,
        names,
        kv=[tuner.is_kv(entry) for entry in route.adapters],
        text_starts=[tuner.text_start(entry) for entry in route.adapters],
    )


def _refuse_second_bos(tuner, route: routing.Route, input_ids, attention_mask) -> None:
    bos = getattr(tuner.model.config, "bos_token_id", None)
    configs = {entry: tuner.peft_config[routing.names_of(entry)[0]] for entry in route.adapters}
    placement.refuse_second_bos(configs, route.adapters, route.rows, input_ids, attention_mask, bos)


def _stored_passes(tuner, route: routing.Route, rows: forward_paths.RowPrompts):
    state = tuner.forward_state
    return state.kv_store.stacked(route.adapters, tuner.model, rows, state.kv_layout)

"""`SoftPromptPlusConfig` (config.py): validation errors and round trips."""

import copy
import json
import pickle

import pytest
import torch
from peft import PeftConfig, PeftModel, get_peft_config, get_peft_model

from peft_softprompt_plus import SoftPromptPlusConfig


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_virtual_tokens": 0}, r"`num_virtual_tokens` must be a positive int \(>= 1\), got 0"),
        ({"num_virtual_tokens": 2.5}, r"`num_virtual_tokens` must be a positive int \(>= 1\), got 2.5"),
        ({"num_virtual_tokens": True}, r"`num_virtual_tokens` must be a positive int \(>= 1\), got True \(bool\)"),
        (
            {"prompt_init": "zeros"},
            r"`prompt_init` must be one of \['random', 'vocab', 'text', 'labels', 'adapter', 'demonstrations'\], "
            r"got 'zeros'",
        ),
        ({"validate_gradients": "maybe"}, r"`validate_gradients` must be one of .*got 'maybe'"),
        ({"forward_path": "fast"}, r"`forward_path` must be one of .*got 'fast'"),
        ({"task_type": "SEQ_2_SEQ_LM"}, r"`task_type` must be one of \['CAUSAL_LM', 'SEQ_CLS'\], got 'SEQ_2_SEQ_LM'"),
        ({"prompt_init": "text", "tokenizer_name_or_path": "tok"}, r"`prompt_init_text` must be a non-empty string"),
        ({"prompt_init": "text", "prompt_init_text": "hi"}, r"`tokenizer_name_or_path` is needed"),
        ({"prompt_init_text": "hi"}, r"`prompt_init_text` is only used with `prompt_init='text'`"),
        ({"init_seed": "1"}, r"`init_seed` must be an int or None, got '1'"),
        ({"modules_to_save": "score"}, r"`modules_to_save` must be a list of module names or None, got 'score'"),
        ({"prompt_init": "labels", "tokenizer_name_or_path": "t"}, r"`prompt_init_labels` must be a non-empty list"),
        (
            {"prompt_init": "labels", "prompt_init_labels": [" a", "  "], "tokenizer_name_or_path": "t"},
            r"`prompt_init_labels` must be a non-empty list of non-empty strings .* got \[' a', '  '\]",
        ),
        (
            {"prompt_init": "labels", "prompt_init_labels": [" a"]},
            r"`tokenizer_name_or_path` is needed when `prompt_init='labels'`",
        ),
        ({"prompt_init_labels": [" a"]}, r"`prompt_init_labels` is only used with `prompt_init='labels'`"),
        ({"reparameterization": "lstm"}, r"`reparameterization` must be one of \['none', 'residual'\], got 'lstm'"),
        ({"residual_hidden": 0}, r"`residual_hidden` must be a positive int, got 0"),
        ({"residual_layer_norm": "yes"}, r"`residual_layer_norm` must be True or False, got 'yes'"),
    ],
)
def test_bad_values_name_field_and_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SoftPromptPlusConfig(**kwargs)


def test_every_bad_field_is_reported_at_once():
    # Independent checks: one bad field never hides another's message.
    with pytest.raises(ValueError) as err:
        SoftPromptPlusConfig(num_virtual_tokens=0, forward_path="fast", init_seed="x", prompt_init_text="hi")
    message = str(err.value)
    assert message.startswith("SoftPromptPlusConfig has 4 problems")
    for field in ("`num_virtual_tokens`", "`forward_path`", "`init_seed`", "`prompt_init_text`"):
        assert field in message


def test_options_are_enums_that_serialise_as_strings(tmp_path):
    import json

    from peft_softprompt_plus.method.config import ForwardPath, PromptInit

    config = SoftPromptPlusConfig(prompt_init="vocab", forward_path=ForwardPath.CONCAT)
    assert config.prompt_init is PromptInit.VOCAB and config.forward_path is ForwardPath.CONCAT
    assert config.prompt_init == "vocab" and f"{config.forward_path}" == "concat"
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["prompt_init"] == "vocab" and saved["forward_path"] == "concat"


def test_every_field_has_help():
    import dataclasses

    own = {f.name for f in dataclasses.fields(SoftPromptPlusConfig)} - {f.name for f in dataclasses.fields(PeftConfig)}
    assert own >= {
        "num_virtual_tokens",
        "prompt_init",
        "prompt_init_text",
        "tokenizer_name_or_path",
        "validate_gradients",
    }
    for f in dataclasses.fields(SoftPromptPlusConfig):
        if f.name in own:
            assert f.metadata.get("help"), f.name


def test_round_trips(tmp_path):
    config = SoftPromptPlusConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=7, prompt_init="vocab", init_seed=3, validate_gradients="warn"
    )
    config.save_pretrained(tmp_path)
    for loaded in (
        PeftConfig.from_pretrained(tmp_path),
        SoftPromptPlusConfig.from_pretrained(tmp_path),
        get_peft_config(config.to_dict()),
        copy.deepcopy(config),
        pickle.loads(pickle.dumps(config)),
    ):
        assert type(loaded) is SoftPromptPlusConfig
        assert loaded.to_dict() == config.to_dict()


def test_no_task_type_is_a_causal_lm_whose_prompt_is_read(make_base, tmp_path):
    # PEFT wraps a config without a task type in a bare PeftModel that calls the base model directly: the prompt
    # used to be silently ignored (the logits equalled the base model's).
    ids = torch.randint(2, 300, (2, 6))
    base = make_base()
    with torch.no_grad():
        plain = base(input_ids=ids).logits
    model = get_peft_model(base, SoftPromptPlusConfig(num_virtual_tokens=4, init_seed=0))
    assert type(model).__name__ == "PeftModelForCausalLM" and model.peft_config["default"].task_type == "CAUSAL_LM"
    with torch.no_grad():
        prompted = model(input_ids=ids).logits
    assert (prompted - plain).abs().max() > 1e-3
    model.save_pretrained(tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    config["task_type"] = None  # as 0.2.0 saved an adapter made without one
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    loaded = PeftModel.from_pretrained(make_base(), tmp_path / "a")
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, prompted)

"""Every public entry point refuses bad input with an error that names the argument (or file), the value and the fix,
and loses nothing: the model's output, weights, `requires_grad` flags and attention setting, and the adapter already
saved on disk, are what they were. One table row per bad input."""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

import peft
import pytest
import torch
from conftest import random_ids
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from peft_softprompt_plus import (
    AdapterFileError,
    DistillOptions,
    SoftPromptPlusConfig,
    check_gradient_flow,
    distill_prompt,
    prompt_embeds,
)
from peft_softprompt_plus.apps.cli import main as cli_main
from peft_softprompt_plus.apps.tiny import tiny_gpt2


@dataclass
class World:
    model: PeftModel  # a prompted tiny GPT-2 with one adapter, saved at `saved`
    base: torch.nn.Module  # a fresh base the load cases load into
    saved: str
    tmp: str
    base_dir: str


@pytest.fixture
def world(tiny_model_dir, tmp_path):
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, init_seed=0),
    )
    saved = str(tmp_path / "saved")
    model.save_pretrained(saved)
    return World(
        model.eval(), AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), saved, str(tmp_path), tiny_model_dir
    )


def _state(world: World) -> dict:
    probe = random_ids(2, 5, seed=99)
    with torch.no_grad():
        prompted = world.model(input_ids=probe).logits.clone()
        plain = world.base(input_ids=probe).logits.clone()
    files = {}
    for folder, _, names in os.walk(world.saved):
        for name in names:
            with open(os.path.join(folder, name), "rb") as handle:
                files[os.path.relpath(os.path.join(folder, name), world.saved)] = handle.read()
    models = {"model": world.model, "base": world.base}
    return {
        "outputs": (prompted, plain),
        "weights": {k: {n: p.detach().clone() for n, p in m.state_dict().items()} for k, m in models.items()},
        "flags": {k: {n: p.requires_grad for n, p in m.named_parameters()} for k, m in models.items()},
        "attention": (world.model.config._attn_implementation, world.base.config._attn_implementation),
        "adapters": list(world.model.peft_config),
        "saved": files,
    }


def _same(before: dict, after: dict) -> None:
    for a, b in zip(before["outputs"], after["outputs"], strict=True):
        assert torch.equal(a, b), "a forward changed"
    for key in ("flags", "attention", "adapters", "saved"):
        assert before[key] == after[key], f"{key} changed"
    for name, weights in before["weights"].items():
        assert weights.keys() == after["weights"][name].keys()
        assert all(torch.equal(w, after["weights"][name][n]) for n, w in weights.items()), f"{name} weights changed"


# ---------------------------------------------------------------------------------------------- the cases

IDS = random_ids(2, 5)
LABELS = IDS.clone()


def _config(**kwargs):
    return lambda w: SoftPromptPlusConfig(**{"task_type": "CAUSAL_LM", **kwargs})


def _attach(**kwargs):
    return lambda w: get_peft_model(w.base, SoftPromptPlusConfig(**{"task_type": "CAUSAL_LM", **kwargs}))


def _forward(**kwargs):
    return lambda w: w.model(**kwargs)


def _generate(**kwargs):
    return lambda w: w.model.generate(**{"max_new_tokens": 2, **kwargs})


def _damaged(edit: Callable[[str], None], how: str = "from_pretrained"):
    """Copy the saved adapter, damage the copy, load it."""

    def run(w: World):
        copy = os.path.join(w.tmp, "damaged")
        shutil.copytree(w.saved, copy)
        edit(copy)
        if how == "from_pretrained":
            return PeftModel.from_pretrained(w.base, copy)
        return w.model.load_adapter(copy, adapter_name="second")

    return run


def _write(name: str, data: bytes):
    return lambda folder: open(os.path.join(folder, name), "wb").write(data)


def _truncate(folder: str) -> None:
    path = os.path.join(folder, "adapter_model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def _edit_config(**changes):
    def edit(folder: str) -> None:
        path = os.path.join(folder, "adapter_config.json")
        config = json.load(open(path))
        config.update(changes)
        json.dump(config, open(path, "w"))

    return edit


def _prompt_values(value: float):
    def edit(folder: str) -> None:
        from safetensors.torch import load_file, save_file

        path = os.path.join(folder, "adapter_model.safetensors")
        tensors = load_file(path)
        tensors["base_model.softprompt_plus.prompt"][0, 0] = value
        save_file(tensors, path)

    return edit


def _remove(name: str):
    return lambda folder: os.remove(os.path.join(folder, name))


def _distill(system_prompt="the quick brown fox jumps over the lazy dog", model=None, **kwargs):
    def run(w: World):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(w.base_dir)
        data = {k: kwargs.pop(k) for k in ("user_turns", "held_out_turns", "probes", "samples") if k in kwargs}
        options = DistillOptions(**{"steps": 1, **kwargs})
        return distill_prompt(model(w) if model else w.base, tokenizer, system_prompt, options, **data)

    return run


def _distill_cli(*argv, files=()):
    """`softprompt-plus distill` on the tiny base, with `files` (name, text) written into the temp folder first."""

    def run(w: World):
        for name, text in files:
            with open(os.path.join(w.tmp, name), "w") as handle:
                handle.write(text)
        default = {"--model": w.base_dir, "--system-prompt-file": "{tmp}/system.txt", "--output-dir": "{tmp}/out"}
        default.update(zip(argv[::2], argv[1::2], strict=True))
        args = [a.format(tmp=w.tmp) for pair in default.items() for a in pair]
        raise SystemExit(cli_main(["distill", *args]))

    return run


SYSTEM_FILE = [("system.txt", "the quick brown fox jumps over the lazy dog\n")]


def _deleted():
    """A prompted tiny GPT-2 whose last adapter was deleted."""
    model = get_peft_model(tiny_gpt2(), SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    model.delete_adapter("default")
    return model


def _cli(*argv):
    def run(w: World):
        args = [a.format(saved=w.saved, tmp=w.tmp) for a in argv]
        code = cli_main(args)
        raise SystemExit(code)

    return run


F = torch.float32
CASES = [
    # config: each field, with its name in the message
    ("config num_virtual_tokens 0", _config(num_virtual_tokens=0), ValueError, ["`num_virtual_tokens`", "0"]),
    ("config num_virtual_tokens -3", _config(num_virtual_tokens=-3), ValueError, ["`num_virtual_tokens`", "-3"]),
    ("config num_virtual_tokens float", _config(num_virtual_tokens=2.5), ValueError, ["`num_virtual_tokens`", "2.5"]),
    ("config num_virtual_tokens bool", _config(num_virtual_tokens=True), ValueError, ["`num_virtual_tokens`", "bool"]),
    ("config num_virtual_tokens str", _config(num_virtual_tokens="8"), ValueError, ["`num_virtual_tokens`", "'8'"]),
    ("config prompt_init", _config(prompt_init="zeros"), ValueError, ["`prompt_init`", "'zeros'", "random"]),
    ("config text without text", _config(prompt_init="text"), ValueError, ["`prompt_init_text`", "non-empty"]),
    (
        "config text without tokenizer",
        _config(prompt_init="text", prompt_init_text="hi"),
        ValueError,
        ["`tokenizer_name_or_path`"],
    ),
    ("config text unused", _config(prompt_init_text="hello"), ValueError, ["`prompt_init_text`", "'hello'"]),
    ("config init_seed", _config(init_seed="7"), ValueError, ["`init_seed`", "'7'"]),
    ("config validate_gradients", _config(validate_gradients="maybe"), ValueError, ["`validate_gradients`", "maybe"]),
    ("config forward_path", _config(forward_path="fast"), ValueError, ["`forward_path`", "'fast'", "shared_kv"]),
    ("config task_type", _config(task_type="SEQ_2_SEQ_LM"), ValueError, ["`task_type`", "SEQ_2_SEQ_LM", "CAUSAL_LM"]),
    ("config modules_to_save str", _config(modules_to_save="score"), ValueError, ["`modules_to_save`", "'score'"]),
    ("config modules_to_save ints", _config(modules_to_save=[1]), ValueError, ["`modules_to_save`", "[1]"]),
    # attach
    (
        "attach a Hub id",
        lambda w: get_peft_model("gpt2", SoftPromptPlusConfig(task_type="CAUSAL_LM")),
        TypeError,
        ["`model`", "str", "'gpt2'", "from_pretrained"],
    ),
    (
        "attach via peft.get_peft_model",
        lambda w: peft.get_peft_model(None, SoftPromptPlusConfig()),
        TypeError,
        ["`model`", "NoneType"],
    ),
    (
        "attach N >= positions",
        _attach(num_virtual_tokens=1_000_000),
        ValueError,
        ["`num_virtual_tokens`=1000000", "128 positions"],
    ),
    ("attach N == positions", _attach(num_virtual_tokens=128), ValueError, ["`num_virtual_tokens`=128"]),
    (
        "attach misspelt modules_to_save",
        _attach(modules_to_save=["ln_ff"]),
        ValueError,
        ["`modules_to_save`", "'ln_ff'", "ln_f"],
    ),
    ("attach tied lm_head", _attach(modules_to_save=["lm_head"]), ValueError, ["`modules_to_save`", "tied"]),
    (
        "attach prefix + N + suffix >= positions",
        _attach(num_virtual_tokens=100, prompt_prefix_ids=[5] * 20, prompt_suffix_ids=[6] * 8),
        ValueError,
        ["128 positions (prompt_prefix_ids 20 + num_virtual_tokens 100 + prompt_suffix_ids 8)", "128 positions."],
    ),
    ("attach prefix outside the vocabulary", _attach(prompt_prefix_ids=[10**6]), ValueError, ["`prompt_prefix_ids`"]),
    (
        "attach from a folder that is no adapter",
        _attach(prompt_init="adapter", prompt_init_adapter="/no/such/adapter"),
        ValueError,
        ["`prompt_init_adapter`='/no/such/adapter'", "adapter_config.json"],
    ),
    ("config prefix ids not ints", _config(prompt_prefix_ids=["a"]), ValueError, ["`prompt_prefix_ids`", "['a']"]),
    ("attach tied wte", _attach(modules_to_save=["wte"]), ValueError, ["`modules_to_save`", "'wte'", "tied"]),
    (
        "attach SEQ_CLS to an LM",
        lambda w: get_peft_model(w.base, SoftPromptPlusConfig(task_type="SEQ_CLS")),
        ValueError,
        ["`task_type`='SEQ_CLS'", "`.score`", "AutoModelForSequenceClassification"],
    ),
    (
        "attach to a module without embeddings",
        lambda w: get_peft_model(torch.nn.Linear(2, 2), SoftPromptPlusConfig()),
        ValueError,
        ["get_input_embeddings", "Linear"],
    ),
    (
        "inject_adapter_in_model",
        lambda w: peft.inject_adapter_in_model(SoftPromptPlusConfig(), w.base),
        ValueError,
        ["inject_adapter_in_model", "get_peft_model", "untouched"],
    ),
    # forward: token ids
    ("forward no inputs", _forward(), ValueError, ["exactly one of `input_ids` and `inputs_embeds`"]),
    ("forward ids as a list", _forward(input_ids=IDS.tolist()), TypeError, ["`input_ids`", "list", "torch.tensor"]),
    ("forward float ids", _forward(input_ids=IDS.float()), ValueError, ["`input_ids`", "float32", ".long()"]),
    ("forward bool ids", _forward(input_ids=IDS > 5), ValueError, ["`input_ids`", "bool"]),
    ("forward negative ids", _forward(input_ids=IDS - 100), ValueError, ["`input_ids`", "outside [0, ", "min -"]),
    ("forward ids past the vocabulary", _forward(input_ids=IDS + 10_000), ValueError, ["`input_ids`", "max 10"]),
    ("forward 1-D ids", _forward(input_ids=IDS[0]), ValueError, ["`input_ids`", "[batch, seq_len]", "unsqueeze(0)"]),
    ("forward 3-D ids", _forward(input_ids=IDS[None]), ValueError, ["`input_ids`", "[1, 2, 5]"]),
    ("forward zero rows", _forward(input_ids=IDS[:0]), ValueError, ["`input_ids`", "[0, 5]", "at least one row"]),
    ("forward zero length", _forward(input_ids=IDS[:, :0]), ValueError, ["`input_ids`", "[2, 0]"]),
    (
        "forward ids and embeds",
        lambda w: w.model(input_ids=IDS, inputs_embeds=torch.zeros(2, 5, 64)),
        ValueError,
        ["exactly one"],
    ),
    ("forward too long", _forward(input_ids=random_ids(1, 125)), ValueError, ["N=4", "L=125", "128 positions"]),
    # forward: attention mask
    (
        "forward mask 0.5",
        _forward(input_ids=IDS, attention_mask=torch.full((2, 5), 0.5)),
        ValueError,
        ["`attention_mask`", "only 0", "[0.5]"],
    ),
    (
        "forward mask 2",
        _forward(input_ids=IDS, attention_mask=torch.full((2, 5), 2)),
        ValueError,
        ["`attention_mask`", "[2]"],
    ),
    ("forward mask -1", _forward(input_ids=IDS, attention_mask=-torch.ones(2, 5)), ValueError, ["`attention_mask`"]),
    (
        "forward mask shape",
        _forward(input_ids=IDS, attention_mask=torch.ones(2, 6)),
        ValueError,
        ["`attention_mask`", "[2, 5]", "[2, 6]"],
    ),
    (
        "forward 4-D mask",
        _forward(input_ids=IDS, attention_mask=torch.ones(2, 1, 5, 5)),
        ValueError,
        ["`attention_mask`", "[2, 5]"],
    ),
    (
        "forward mask as a list",
        _forward(input_ids=IDS, attention_mask=[[1] * 5] * 2),
        TypeError,
        ["`attention_mask`", "list"],
    ),
    (
        "forward an empty row",
        _forward(input_ids=IDS, attention_mask=torch.tensor([[1] * 5, [0] * 5])),
        ValueError,
        ["`attention_mask`", "no real token", "[1]"],
    ),
    # forward: labels
    ("forward labels shape", _forward(input_ids=IDS, labels=LABELS[:, :3]), ValueError, ["`labels`", "[2, 5]"]),
    ("forward labels float", _forward(input_ids=IDS, labels=LABELS.float()), ValueError, ["`labels`", "float32"]),
    (
        "forward labels past vocab",
        _forward(input_ids=IDS, labels=LABELS + 10_000),
        ValueError,
        ["`labels`", "(or -100)"],
    ),
    ("forward labels -5", _forward(input_ids=IDS, labels=torch.full((2, 5), -5)), ValueError, ["`labels`", "min -5"]),
    ("forward labels list", _forward(input_ids=IDS, labels=LABELS.tolist()), TypeError, ["`labels`", "list"]),
    ("forward labels 1-D", _forward(input_ids=IDS, labels=LABELS[0]), ValueError, ["`labels`", "[5]"]),
    # forward: embeddings
    (
        "forward 2-D embeds",
        _forward(inputs_embeds=torch.zeros(5, 64)),
        ValueError,
        ["`inputs_embeds`", "[batch, seq_len, hidden size]", "unsqueeze(0)"],
    ),
    (
        "forward embeds width",
        _forward(inputs_embeds=torch.zeros(2, 5, 32)),
        ValueError,
        ["`inputs_embeds`", "hidden size 64", "[2, 5, 32]"],
    ),
    (
        "forward embeds ints",
        _forward(inputs_embeds=torch.zeros(2, 5, 64, dtype=torch.long)),
        ValueError,
        ["`inputs_embeds`", "floating point"],
    ),
    (
        "forward embeds float64",
        _forward(inputs_embeds=torch.zeros(2, 5, 64, dtype=torch.float64)),
        ValueError,
        ["`inputs_embeds`", "torch.float32", "float64"],
    ),
    ("forward embeds list", _forward(inputs_embeds=[[0.0] * 64]), TypeError, ["`inputs_embeds`", "list"]),
    ("forward empty embeds", _forward(inputs_embeds=torch.zeros(2, 0, 64)), ValueError, ["`inputs_embeds`", "[2, 0"]),
    # forward: other keywords
    (
        "forward position_ids",
        _forward(input_ids=IDS, position_ids=IDS),
        ValueError,
        ["`position_ids`", "attention_mask", "packing"],
    ),
    ("forward cache", lambda w: w.model(input_ids=IDS, cache=object()), ValueError, ["`cache`", "generate"]),
    (
        "forward past_key_values",
        lambda w: w.model(input_ids=IDS, past_key_values=object()),
        ValueError,
        ["`past_key_values`"],
    ),
    (
        "forward token_type_ids shape",
        _forward(input_ids=IDS, token_type_ids=IDS[:, :2]),
        ValueError,
        ["`token_type_ids`", "[2, 5]"],
    ),
    (
        "forward token_type_ids range",
        _forward(input_ids=IDS, token_type_ids=IDS + 10_000),
        ValueError,
        ["`token_type_ids`", "outside"],
    ),
    (
        "forward token_type_ids float",
        _forward(input_ids=IDS, token_type_ids=IDS.float()),
        ValueError,
        ["`token_type_ids`", "float32"],
    ),
    (
        "forward adapter_names unknown",
        _forward(input_ids=IDS, adapter_names=["default", "nope"]),
        ValueError,
        ["'nope'", "adapters: ['default']"],
    ),
    (
        "forward adapter_names length",
        _forward(input_ids=IDS, adapter_names=["default"]),
        ValueError,
        ["`adapter_names` has 1 entries", "2 rows"],
    ),
    (
        "forward adapter_names str",
        _forward(input_ids=IDS, adapter_names="default"),
        ValueError,
        ["`adapter_names`", "list", "str"],
    ),
    # generate
    ("generate ids list", _generate(input_ids=IDS.tolist()), TypeError, ["`input_ids`", "list"]),
    ("generate float ids", _generate(input_ids=IDS.float()), ValueError, ["`input_ids`", "float32"]),
    ("generate 1-D ids", _generate(input_ids=IDS[0]), ValueError, ["`input_ids`", "unsqueeze(0)"]),
    ("generate ids past vocab", _generate(input_ids=IDS + 10_000), ValueError, ["`input_ids`", "outside"]),
    ("generate zero length", _generate(input_ids=IDS[:, :0]), ValueError, ["`input_ids`", "[2, 0]"]),
    ("generate no ids", _generate(), ValueError, ["`input_ids` is required"]),
    ("generate embeds", _generate(inputs_embeds=torch.zeros(2, 5, 64)), ValueError, ["`input_ids` is required"]),
    (
        "generate position_ids",
        _generate(input_ids=IDS, position_ids=IDS),
        ValueError,
        ["`position_ids`", "attention_mask"],
    ),
    (
        "generate past_key_values",
        _generate(input_ids=IDS, past_key_values=object()),
        ValueError,
        ["`past_key_values`"],
    ),
    (
        "generate mask 0.5",
        _generate(input_ids=IDS, attention_mask=torch.full((2, 5), 0.5)),
        ValueError,
        ["`attention_mask`", "[0.5]"],
    ),
    (
        "generate mask shape",
        _generate(input_ids=IDS, attention_mask=torch.ones(3, 5)),
        ValueError,
        ["`attention_mask`", "[3, 5]"],
    ),
    (
        "generate past the positions",
        _generate(input_ids=IDS, max_new_tokens=200),
        ValueError,
        ["`generate` would need 209 positions", "N=4", "L=5", "(200)", "at most 119"],
    ),
    (
        "generate max_length past the positions",
        _generate(input_ids=IDS, max_new_tokens=None, max_length=500),
        ValueError,
        ["would need", "has 128"],
    ),
    (
        "generate adapter_names unknown",
        _generate(input_ids=IDS, adapter_names=["x", "default"]),
        ValueError,
        ["'x'", "adapters"],
    ),
    (
        "generate adapter_names length",
        _generate(input_ids=IDS, adapter_names=["default"] * 3),
        ValueError,
        ["3 entries", "2 rows"],
    ),
    # save
    ("save to ''", lambda w: w.model.save_pretrained(""), ValueError, ["`save_directory`", "''", "current directory"]),
    ("save to '   '", lambda w: w.model.save_pretrained("   "), ValueError, ["`save_directory`"]),
    ("save to None", lambda w: w.model.save_pretrained(None), ValueError, ["`save_directory`", "NoneType"]),
    ("save to 42", lambda w: w.model.save_pretrained(42), ValueError, ["`save_directory`", "int"]),
    (
        "save to a file",
        lambda w: w.model.save_pretrained(os.path.join(w.saved, "adapter_config.json")),
        ValueError,
        ["`save_directory`", "got the file", "adapter_config.json"],
    ),
    # load (from_pretrained and load_adapter): files named, the base handed back
    (
        "load config without weights",
        _damaged(_remove("adapter_model.safetensors")),
        AdapterFileError,
        ["adapter_config.json but none of", "adapter_model.safetensors", "Save the adapter again"],
    ),
    ("load truncated weights", _damaged(_truncate), AdapterFileError, ["adapter_model.safetensors", "damaged"]),
    (
        "load garbage weights",
        _damaged(_write("adapter_model.safetensors", b"\x00garbage" * 9)),
        AdapterFileError,
        ["adapter_model.safetensors", "damaged"],
    ),
    ("load empty weights", _damaged(_write("adapter_model.safetensors", b"")), AdapterFileError, ["damaged"]),
    (
        "load invalid JSON",
        _damaged(_write("adapter_config.json", b"{not json")),
        AdapterFileError,
        ["adapter_config.json", "not valid JSON"],
    ),
    (
        "load JSON list",
        _damaged(_write("adapter_config.json", b"[1, 2]")),
        AdapterFileError,
        ["adapter_config.json", "JSON object", "list"],
    ),
    (
        "load unknown peft_type",
        _damaged(_edit_config(peft_type="SOFTPROMPT_PLUSPLUS")),
        AdapterFileError,
        ["peft_type='SOFTPROMPT_PLUSPLUS'", "SOFTPROMPT_PLUS"],
    ),
    (
        "load edited num_virtual_tokens",
        _damaged(_edit_config(num_virtual_tokens=7)),
        AdapterFileError,
        ["holds 4 virtual tokens", "num_virtual_tokens=7", "Restore"],
    ),
    ("load NaN prompt", _damaged(_prompt_values(float("nan"))), AdapterFileError, ["1 non-finite", "NaN"]),
    ("load inf prompt", _damaged(_prompt_values(float("inf"))), AdapterFileError, ["non-finite"]),
    (
        "load no config",
        _damaged(_remove("adapter_config.json")),
        AdapterFileError,
        ["no adapter_config.json", "save_pretrained"],
    ),
    (
        "load_adapter config without weights",
        _damaged(_remove("adapter_model.safetensors"), "load_adapter"),
        AdapterFileError,
        ["none of"],
    ),
    ("load_adapter truncated weights", _damaged(_truncate, "load_adapter"), AdapterFileError, ["damaged"]),
    (
        "load_adapter invalid JSON",
        _damaged(_write("adapter_config.json", b"{"), "load_adapter"),
        AdapterFileError,
        ["not valid JSON"],
    ),
    (
        "load_adapter edited num_virtual_tokens",
        _damaged(_edit_config(num_virtual_tokens=2), "load_adapter"),
        AdapterFileError,
        ["num_virtual_tokens=2"],
    ),
    (
        "load_adapter NaN prompt",
        _damaged(_prompt_values(float("nan")), "load_adapter"),
        AdapterFileError,
        ["non-finite"],
    ),
    (
        "load_adapter unknown peft_type",
        _damaged(_edit_config(peft_type="NOPE"), "load_adapter"),
        AdapterFileError,
        ["peft_type='NOPE'"],
    ),
    (
        "load wrong hidden size",
        lambda w: PeftModel.from_pretrained(
            AutoModelForCausalLM.from_config(w.base.config.__class__(**{**w.base.config.to_dict(), "n_embd": 32})),
            w.saved,
        ),
        AdapterFileError,
        ["hidden size 64", "is 32"],
    ),
    # adapter management
    (
        "set_adapter a list of input adapters",
        lambda w: w.model.set_adapter(["default", "default"]),
        ValueError,
        ["`set_adapter`", "['default', 'default']", "input", "only KV adapters", "prompt_level='kv'"],
    ),
    (
        "set_adapter unknown",
        lambda w: w.model.set_adapter("nope"),
        ValueError,
        ["Adapter nope not found", "adapters: ['default']", "`adapter_name`='nope'"],
    ),
    ("set_adapter int", lambda w: w.model.set_adapter(3), ValueError, ["`set_adapter`", "int"]),
    (
        "delete unknown",
        lambda w: w.model.delete_adapter("nope"),
        ValueError,
        ["Adapter nope does not exist", "adapters: ['default']", "`adapter_name`='nope'"],
    ),
    (
        "delete unknown on the tuner",
        lambda w: w.model.base_model.delete_adapter("nope"),
        ValueError,
        ["Adapter nope does not exist", "adapters: ['default']"],
    ),
    ("delete a list", lambda w: w.model.delete_adapter(["default"]), ValueError, ["`delete_adapter`", "list"]),
    (
        "prompt of unknown",
        lambda w: w.model.base_model.prompt("nope"),
        ValueError,
        ["Adapter nope does not exist", "adapters: ['default']"],
    ),
    ("merge", lambda w: w.model.merge_and_unload(), ValueError, ["cannot be merged", "unload()"]),
    # check_gradient_flow
    ("gradient check not a model", lambda w: check_gradient_flow(IDS), TypeError, ["`model`", "Tensor"]),
    ("gradient check batch str", lambda w: check_gradient_flow(w.model, "text"), TypeError, ["`batch`", "str"]),
    (
        "gradient check optimizer",
        lambda w: check_gradient_flow(w.model, None, object()),
        TypeError,
        ["`optimizer`", "object"],
    ),
    ("gradient check loss_fn", lambda w: check_gradient_flow(w.model, None, None, "ce"), TypeError, ["`loss_fn`"]),
    (
        "gradient check float ids",
        lambda w: check_gradient_flow(w.model, {"input_ids": IDS.float(), "labels": IDS}),
        ValueError,
        ["`batch`", "float32"],
    ),
    # distill_prompt: checked before the model changes
    ("distill empty system prompt", _distill(""), ValueError, ["`system_prompt`", "non-empty", "''"]),
    ("distill blank system prompt", _distill(" \n "), ValueError, ["`system_prompt`", "' \\n '"]),
    (
        "distill without a chat template",
        _distill(num_virtual_tokens=2),
        ValueError,
        ["`tokenizer`", "no chat template", "chat=False", "--plain"],
    ),
    (
        "distill prompt shorter than N",
        _distill("red blue", chat=False, num_virtual_tokens=16),
        ValueError,
        ["`system_prompt` is 3 tokens", "`num_virtual_tokens`=16", "<= 3"],
    ),
    ("distill a PeftModel", _distill(model=lambda w: w.model, chat=False), ValueError, ["`model`", "PeftModel"]),
    ("distill steps 0", _distill(chat=False, steps=0), ValueError, ["`steps`", "0"]),
    ("distill N 0", _distill(chat=False, num_virtual_tokens=0), ValueError, ["`num_virtual_tokens`", "0"]),
    ("distill lr", _distill(chat=False, lr=-1.0), ValueError, ["`lr`", "-1.0"]),
    ("distill user_turns str", _distill(chat=False, user_turns="hello"), ValueError, ["`user_turns`", "str"]),
    (
        "distill evaluate_at past steps",
        _distill(chat=False, evaluate_at=(5,)),
        ValueError,
        ["`evaluate_at`", "[5]", "`steps`=1"],
    ),
    # prompt_embeds (serving.py)
    ("serve not a model", lambda w: prompt_embeds(torch.nn.Linear(2, 2), IDS), TypeError, ["`model`", "Linear"]),
    (
        "serve a LoRA model",
        lambda w: prompt_embeds(get_peft_model(tiny_gpt2(), peft.LoraConfig(target_modules=["c_attn"])), IDS),
        TypeError,
        ["`model`", "LORA", "SOFTPROMPT_PLUS"],
    ),
    ("serve the bare base", lambda w: prompt_embeds(w.base, IDS), TypeError, ["`model`", "GPT2LMHeadModel"]),
    (
        "serve unknown adapter",
        lambda w: prompt_embeds(w.model, IDS, adapter_name="nope"),
        ValueError,
        ["Adapter nope does not exist", "adapters: ['default']"],
    ),
    (
        "serve adapter list",
        lambda w: prompt_embeds(w.model, IDS, adapter_name=["default"]),
        ValueError,
        ["`adapter_name`", "list"],
    ),
    (
        "serve a SEQ_CLS adapter",
        lambda w: prompt_embeds(
            get_peft_model(tiny_gpt2(task="SEQ_CLS"), SoftPromptPlusConfig(task_type="SEQ_CLS")), IDS
        ),
        ValueError,
        ["`adapter_name`='default'", "SEQ_CLS", "head"],
    ),
    (
        "serve modules_to_save",
        lambda w: prompt_embeds(
            get_peft_model(tiny_gpt2(), SoftPromptPlusConfig(task_type="CAUSAL_LM", modules_to_save=["ln_f"])), IDS
        ),
        ValueError,
        ["`modules_to_save`=['ln_f']", "Serve it with this library"],
    ),
    ("serve no active adapter", lambda w: prompt_embeds(_deleted(), IDS), ValueError, ["`adapter_name`", "0 active"]),
    ("serve ids list", lambda w: prompt_embeds(w.model, IDS.tolist()), TypeError, ["`input_ids`", "list"]),
    ("serve float ids", lambda w: prompt_embeds(w.model, IDS.float()), ValueError, ["`input_ids`", "float32"]),
    ("serve 3-D ids", lambda w: prompt_embeds(w.model, IDS[None]), ValueError, ["`input_ids`", "[L]", "[1, 2, 5]"]),
    ("serve ids past vocab", lambda w: prompt_embeds(w.model, IDS + 10_000), ValueError, ["`input_ids`", "outside"]),
    ("serve no tokens", lambda w: prompt_embeds(w.model, IDS[:, :0]), ValueError, ["`input_ids`", "[2, 0]"]),
    (
        "serve mask shape",
        lambda w: prompt_embeds(w.model, IDS, torch.ones(2, 6)),
        ValueError,
        ["`attention_mask`", "[2, 5]", "[2, 6]"],
    ),
    (
        "serve mask 1-D for a batch",
        lambda w: prompt_embeds(w.model, IDS, torch.ones(5)),
        ValueError,
        ["`attention_mask`", "[2, 5]", "[5]"],
    ),
    (
        "serve mask 0.5",
        lambda w: prompt_embeds(w.model, IDS, torch.full((2, 5), 0.5)),
        ValueError,
        ["`attention_mask`", "[0.5]"],
    ),
    (
        "serve an empty row",
        lambda w: prompt_embeds(w.model, IDS, torch.tensor([[1] * 5, [0] * 5])),
        ValueError,
        ["`attention_mask`", "no real token", "[1]"],
    ),
    (
        "serve too long",
        lambda w: prompt_embeds(w.model, random_ids(1, 125)),
        ValueError,
        ["`input_ids` row 0 has 125 real tokens", "N=4", "129 positions", "has 128", "at most 124"],
    ),
    ("serve as_list str", lambda w: prompt_embeds(w.model, IDS, as_list="yes"), ValueError, ["`as_list`", "'yes'"]),
    (
        "serve engine_scales_embeddings int",
        lambda w: prompt_embeds(w.model, IDS, engine_scales_embeddings=1),
        ValueError,
        ["`engine_scales_embeddings`", "int 1"],
    ),
    # command line: one `error:` line naming the bad argument, exit status 2; `{tmp}` and `{saved}` are the world's
    (
        "cli inspect missing",
        _cli("inspect", "{tmp}/nope"),
        SystemExit,
        ["inspect: error:", "`adapter`='{tmp}/nope'", "neither an existing folder nor a Hub repo id"],
    ),
    (
        "cli inspect damaged",
        lambda w: (_truncate(w.saved), _cli("inspect", "{saved}")(w)),
        SystemExit,
        ["'{saved}/adapter_model.safetensors' is damaged", "Save the adapter again"],
    ),
    (
        "cli inspect invalid JSON",
        lambda w: (_write("adapter_config.json", b"{")(w.saved), _cli("inspect", "{saved}")(w)),
        SystemExit,
        ["'{saved}/adapter_config.json' is not valid JSON"],
    ),
    (
        "cli inspect --base missing",
        _cli("inspect", "{saved}", "--base", "{tmp}/nobase"),
        SystemExit,
        ["`--base`='{tmp}/nobase' is neither an existing folder"],
    ),
    (
        "cli demo --model missing",
        _cli("demo", "--model", "./no/such/model"),
        SystemExit,
        ["demo: error:", "`--model`='./no/such/model' is neither an existing folder"],
    ),
    (
        "cli demo --steps 0",
        _cli("demo", "--steps", "0"),
        SystemExit,
        ["demo: error:", "`--steps` must be >= 1, got 0"],
    ),
    ("cli run without command", _cli("run"), SystemExit, ["run: error:", "needs a command after `--`"]),
    (
        "cli distill --model missing",
        _distill_cli("--model", "./no/such/model", files=SYSTEM_FILE),
        SystemExit,
        ["distill: error:", "`--model`='./no/such/model' is not a folder"],
    ),
    (
        "cli distill no system prompt file",
        _distill_cli("--system-prompt-file", "{tmp}/none.txt"),
        SystemExit,
        ["`--system-prompt-file`='{tmp}/none.txt' is not a file"],
    ),
    (
        "cli distill empty system prompt",
        _distill_cli(files=[("system.txt", "\n  \n")]),
        SystemExit,
        ["`--system-prompt-file`='{tmp}/system.txt' is empty"],
    ),
    (
        "cli distill --steps 0",
        _distill_cli("--steps", "0", files=SYSTEM_FILE),
        SystemExit,
        ["distill: error:", "`--steps` must be >= 1, got 0"],
    ),
    (
        "cli distill -N 0",
        _distill_cli("--num-virtual-tokens", "0", files=SYSTEM_FILE),
        SystemExit,
        ["`--num-virtual-tokens` must be >= 1, got 0"],
    ),
    (
        "cli distill --user-file missing",
        _distill_cli("--user-file", "{tmp}/u.txt", files=SYSTEM_FILE),
        SystemExit,
        ["`--user-file`='{tmp}/u.txt' is not a file"],
    ),
    (
        "cli distill empty --user-file",
        _distill_cli("--user-file", "{tmp}/u.txt", files=SYSTEM_FILE + [("u.txt", "\n")]),
        SystemExit,
        ["`--user-file`='{tmp}/u.txt' holds no user turn"],
    ),
    (
        "cli distill --output-dir a file",
        _distill_cli("--output-dir", "{tmp}/system.txt", files=SYSTEM_FILE),
        SystemExit,
        ["`--output-dir`='{tmp}/system.txt' is a file"],
    ),
    (
        "cli distill no chat template",
        _distill_cli("--num-virtual-tokens", "2", files=SYSTEM_FILE),
        SystemExit,
        ["`--model`=", "has no chat template", "Pass --plain"],
    ),
    (
        "cli run unknown command",
        _cli("run", "--", "no-such-program-xyz"),
        SystemExit,
        ["run: error:", "'no-such-program-xyz' not found on PATH"],
    ),
]
# Cases that change the saved folder on purpose (they damage it to test the CLI).
DAMAGES_SAVED = {"cli inspect damaged", "cli inspect invalid JSON"}


def test_the_table_has_a_hundred_cases():
    assert len(CASES) >= 100 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("name", "action", "error", "words"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_and_loses_nothing(world, capsys, name, action, error, words):
    before = _state(world)
    with pytest.raises(error) as raised:
        action(world)
    if error is SystemExit:
        assert raised.value.code == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
        message, words = err, [word.format(tmp=world.tmp, saved=world.saved) for word in words]
    else:
        message = str(raised.value)
    for word in words:
        assert word in message, f"{word!r} not in: {message}"
    after = _state(world) if name not in DAMAGES_SAVED else {**_state(world), "saved": before["saved"]}
    _same(before, after)


def test_the_cli_fails_fast_on_a_missing_path(tmp_path):
    # Checked before torch, transformers and PEFT are imported: well under the 2 s they take to import.
    import time

    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "peft_softprompt_plus", "inspect", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.perf_counter() - start
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "error:" in done.stderr
    assert elapsed < 2.0, f"{elapsed:.1f} s"

"""A KV adapter folded to start its text at N (files/kv_fold.py): the folded adapter's logits and greedy tokens on a
text equal the original's, whose text starts at S > N, on Llama, Qwen2, Gemma-2 (its window wider than any text
here), Phi-3 and GPT-NeoX (partial rotary); from a folder (saved and loaded back) and from a loaded model (in place,
then CARTRIDGE export); refused on GPT-2 and on a base config that differs from the adapter's."""

import json

import pytest
import torch
import transformers
from peft import PeftModel, get_peft_model
from transformers import DynamicCache

from peft_softprompt_plus import SoftPromptPlusConfig, fold_adapter, save_folded, to_cartridge
from peft_softprompt_plus.apps.tiny import FAMILIES

VOCAB = 300
N, S = 5, 17
OVERRIDES = {  # no window cuts here (a window is checked per request: tests/method/test_rotary_fold.py)
    "llama": {},
    "qwen2": dict(use_sliding_window=False, sliding_window=None),
    "gemma2": dict(sliding_window=4096),  # Gemma-2 needs a window; this one reaches past every text here
    "phi3": dict(partial_rotary_factor=0.5),
    "gpt_neox": {},  # rotary_pct 0.25
}
IDS = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
NEW_TOKENS = 6


def base(name: str):
    config_name, kwargs = FAMILIES[name]
    config = getattr(transformers, config_name)(vocab_size=VOCAB, **{**kwargs, **OVERRIDES.get(name, {})})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config).eval()


def kv_adapter(name: str, start: int = S):
    """A KV adapter whose text starts at `start`. Its keys are made at N (a window refuses a later start at attach,
    since the window measures distances from the text), then its start is moved: the keys it reads don't change."""
    config = SoftPromptPlusConfig(num_virtual_tokens=N, prompt_level="kv", init_seed=3)
    model = get_peft_model(base(name), config).eval()
    model.peft_config["default"].kv_text_start = start
    return model


def reference(name: str, values: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The base model reading `values` `[layers, 2, Hkv, N, hd]` from its cache with the text at `start`, without this
    package: the logits on IDS and the greedy tokens, one full forward per new token."""
    model, rows = base(name), IDS.shape[0]

    def logits(ids):
        cache = DynamicCache()
        for layer in range(values.shape[0]):
            cache.update(values[layer, 0].expand(rows, -1, -1, -1), values[layer, 1].expand(rows, -1, -1, -1), layer)
        positions = torch.arange(start, start + ids.shape[1]).expand(rows, -1)
        mask = torch.ones(rows, N + ids.shape[1], dtype=torch.long)
        with torch.no_grad():
            return model(input_ids=ids, cache=cache, attention_mask=mask, position_ids=positions).logits

    tokens = IDS
    for _ in range(NEW_TOKENS):
        tokens = torch.cat([tokens, logits(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return logits(IDS), tokens


def logits_and_tokens(model):
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
        tokens = model.generate(input_ids=IDS, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=1)
    return logits, tokens


def stored(model) -> torch.Tensor:
    return model.base_model.prompt_bank.values("default").detach().clone()


@pytest.mark.parametrize("name", sorted(OVERRIDES))
def test_a_folded_folder_computes_what_the_original_computed(name, tmp_path):
    original = kv_adapter(name)
    original.save_pretrained(tmp_path / "original")
    want_logits, want_tokens = reference(name, stored(original), S)
    config = save_folded(tmp_path / "original", tmp_path / "folded", model_config=original.get_base_model().config)
    assert config["kv_text_start"] == N
    folded = PeftModel.from_pretrained(base(name), tmp_path / "folded").eval()
    assert folded.peft_config["default"].kv_text_start == N
    got_logits, got_tokens = logits_and_tokens(folded)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_tokens, want_tokens)
    unfolded_at_n, _ = reference(name, stored(original), N)  # the same keys read from N without the fold
    assert (unfolded_at_n - want_logits).abs().max() > 1e-3


def test_a_loaded_adapter_folds_in_place_and_then_exports_to_cartridge(tmp_path):
    model = kv_adapter("llama")
    want_logits, want_tokens = logits_and_tokens(model)
    with pytest.raises(ValueError, match=r"starts its text at kv_text_start=17, not at N=5"):
        to_cartridge(model, tmp_path / "cartridge")
    config, values = fold_adapter(model)  # returned, the model unchanged
    assert config["kv_text_start"] == N and model.peft_config["default"].kv_text_start == S
    fold_adapter(model, in_place=True)
    assert model.peft_config["default"].kv_text_start == N
    assert torch.equal(model.base_model.prompt_bank.values("default").detach(), values)
    got_logits, got_tokens = logits_and_tokens(model)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_tokens, want_tokens)
    to_cartridge(model, tmp_path / "cartridge")
    assert json.loads((tmp_path / "cartridge" / "adapter_config.json").read_text())["peft_type"] == "CARTRIDGE"


def test_a_folder_folds_with_its_base_s_config_or_refuses_another(tmp_path):
    model = kv_adapter("llama")
    model.save_pretrained(tmp_path / "adapter")
    base_config = model.get_base_model().config
    config, values = fold_adapter(tmp_path / "adapter", model_config=base_config)
    assert config["kv_text_start"] == N and list(values.shape) == [2, 2, 2, N, 16]
    other = transformers.LlamaConfig(**{**base_config.to_dict(), "rope_parameters": {"rope_theta": 500.0}})
    with pytest.raises(ValueError, match=r"recorded on another base model .*rope_parameters"):
        fold_adapter(tmp_path / "adapter", model_config=other)
    with pytest.raises(ValueError, match=r"`model_config` is None, and the base of `source`=.* Pass `model_config="):
        fold_adapter(tmp_path / "adapter")  # a base built in memory: no folder to read its config from


def test_absolute_positions_are_refused_and_an_input_adapter_has_nothing_to_fold():
    gpt2 = get_peft_model(base("gpt2"), SoftPromptPlusConfig(num_virtual_tokens=N, prompt_level="kv", kv_text_start=S))
    with pytest.raises(ValueError, match=r"gpt2 adds learned absolute position embeddings"):
        fold_adapter(gpt2)
    with pytest.raises(ValueError, match=r"only a KV adapter \(prompt_level='kv'\) stores keys to fold"):
        fold_adapter(get_peft_model(base("llama"), SoftPromptPlusConfig(num_virtual_tokens=N)))

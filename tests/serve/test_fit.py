"""KV adapters made to fit vLLM by the front (serve/fit.py, serve/compose.py), on a tiny Llama behind
the fake vLLM of test_app.py running this package's connector: an adapter whose text starts past N is folded at
load, a composition is served by name, and each one's published keys/values, read by the base model as vLLM reads
them (a cache of N slots, the text at N), give the greedy tokens of our `generate`. A misfit is refused at load."""

import openai
import pytest
import torch
import transformers
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from test_app import KEY, UPSTREAM_MODEL, _saved_hash, _Server, fake_vllm
from transformers import AutoModelForCausalLM, DynamicCache

from peft_softprompt_plus import SoftPromptPlusConfig, fold_adapter, fold_kv_prompt, save_folded
from peft_softprompt_plus._names import VLLM_KV_PARAM
from peft_softprompt_plus.apps.tiny import FAMILIES, tiny_family, tiny_tokenizer
from peft_softprompt_plus.serve.app import build_app
from peft_softprompt_plus.serve.fit import check_window, engine_shape
from peft_softprompt_plus.serve.front import Adapter, Front
from peft_softprompt_plus.serve.requests import FrontError

NEW_TOKENS = 6
TEXT = "the cat jumps over the lazy dog"


def _save_llama(folder, layers: int = 2) -> str:
    tokenizer = tiny_tokenizer()
    model = tiny_family("llama", vocab_size=len(tokenizer))
    if layers != 2:
        config = model.config
        config.num_hidden_layers = layers
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _kv_adapter(base_dir: str, folder, seed: int, n: int, start=None) -> str:
    """A KV adapter of `n` positions made on the base at `base_dir`, its text start moved to `start` (the keys it
    stores don't change: a text at `start` reads them as they are)."""
    config = SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=n, prompt_level="kv", init_seed=seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), config)
    if start is not None:
        model.peft_config["default"].kv_text_start = start
    model.save_pretrained(folder)
    return str(folder)


def _ours(base_dir: str, folders: dict, active, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Our model's logits on `ids` and `generate`'s greedy tokens, `active` (a name, or a list composed by
    `set_adapter`) reading the adapters of `folders`."""
    names = list(folders)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), folders[names[0]], names[0])
    for name in names[1:]:
        model.load_adapter(folders[name], adapter_name=name)
    model.set_adapter(active)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]  # [L, V]
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return logits, out[0, len(ids) :].tolist()


def _engine(base_dir: str, values: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """What vLLM computes for the published `values` `[layers, 2, Hkv, N, hd]`: the base model alone, its cache's N
    slots holding them and the text at positions N..; its logits on `ids` and greedy tokens, one full forward each."""
    model, n = AutoModelForCausalLM.from_pretrained(base_dir).eval(), values.shape[-2]

    def logits(tokens: list[int]) -> torch.Tensor:
        cache = DynamicCache()
        for layer in range(values.shape[0]):
            cache.update(values[layer, 0][None], values[layer, 1][None], layer)
        with torch.no_grad():
            return model(
                input_ids=torch.tensor([tokens]),
                cache=cache,
                attention_mask=torch.ones(1, n + len(tokens), dtype=torch.long),
                position_ids=torch.arange(n, n + len(tokens))[None],
            ).logits[0]  # [L, V]

    tokens = list(ids)
    for _ in range(NEW_TOKENS):
        tokens.append(int(logits(tokens)[-1].argmax()))
    return logits(ids), tokens[len(ids) :]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-kv-fit")
    base_dir = _save_llama(root / "tiny-llama")
    folders = {
        "a": _kv_adapter(base_dir, root / "a", seed=1, n=4),
        "late": _kv_adapter(base_dir, root / "late", seed=2, n=4, start=7),
        "b": _kv_adapter(base_dir, root / "b", seed=3, n=3),
    }
    share = root / "share"
    share.mkdir(mode=0o750)
    front = Front(base_dir, kv_share=str(share))
    for name, folder in folders.items():
        front.add(name, folder)
    record: list = []
    shape = engine_shape(front.base.config)
    upstream = _Server(fake_vllm(record, kv_share=str(share), model=(shape.layers, shape.kv_heads, shape.head_size)))
    server = _Server(build_app(front, upstream.url, UPSTREAM_MODEL, api_key=KEY, allow_adapter_updates=True))
    client = openai.OpenAI(api_key=KEY, base_url=f"{server.url}/v1", max_retries=0)
    yield dict(root=root, base=base_dir, folders=folders, share=share, front=front, record=record, client=client)
    server.stop()
    upstream.stop()


def _published(llama, adapter) -> torch.Tensor:
    return load_file(str(llama["share"] / f"{adapter.kv}.safetensors"))["kv_prompt"]


def _served_body(llama, name: str) -> dict:
    """The upstream body of a completion to `name` through the front, once the fake vLLM's connector served it."""
    llama["record"].clear()
    answer = llama["client"].completions.create(model=name, prompt=TEXT, max_tokens=3)
    assert answer.choices[0].text == "hello world"  # the connector's mark checked by the front
    (body,) = llama["record"]
    return body


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "gemma2", "gpt_neox", "gpt2"])
def test_the_engine_s_shape_read_from_the_config_is_the_one_a_kv_prompt_holds(family):
    model = tiny_family(family)
    config = SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, prompt_level="kv")
    values = get_peft_model(model, config).base_model.prompt_bank.values("default")  # [layers, 2, Hkv, N, hd]
    shape = engine_shape(model.config)
    assert (shape.layers, shape.kv_heads, shape.head_size) == (values.shape[0], values.shape[2], values.shape[4])


def test_an_adapter_whose_text_starts_past_n_is_folded_at_load_and_reads_as_our_generate(llama):
    front, folder = llama["front"], llama["folders"]["late"]
    adapter = front.adapters["late"]
    assert adapter.positions == 4 and adapter.folded_from == 7 and adapter.kv_start == 7
    published = _published(llama, adapter)
    folded_config, folded = fold_adapter(folder, model_config=front.base.config)
    assert torch.equal(published, folded) and folded_config["kv_text_start"] == 4
    assert not torch.equal(published[:, 0], adapter.kv_values[:, 0])  # the keys moved; the values did not
    assert torch.equal(published[:, 1], adapter.kv_values[:, 1])
    save_folded(folder, llama["root"] / "late-folded", model_config=front.base.config)
    assert adapter.kv == _saved_hash(str(llama["root"] / "late-folded"))  # the folded adapter, as saved
    body = _served_body(llama, "late")
    ids = front.token_ids(TEXT)
    assert body["prompt"] == [front.placeholder] * 4 + ids
    assert body["kv_transfer_params"] == {VLLM_KV_PARAM: adapter.kv}
    ours = _ours(llama["base"], {"late": folder}, "late", ids)  # the text at 7, the keys as trained
    engine = _engine(llama["base"], published, ids)
    assert engine[1] == ours[1] and (engine[0] - ours[0]).abs().max() < 1e-5
    unfolded = _engine(llama["base"], adapter.kv_values, ids)[0]  # the text at 4 reading the keys as trained
    assert (unfolded - ours[0]).abs().max() > 1e-3


@pytest.mark.parametrize("parts", [("a", "b"), ("a", "late")])
def test_a_composition_by_name_is_the_caches_concatenated_and_reads_as_set_adapter_of_the_list(llama, parts):
    front, folders = llama["front"], llama["folders"]
    name = "+".join(parts)
    adapter = front.compose(name, list(parts))
    try:
        published = _published(llama, adapter)
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama["base"]), folders["a"], "a")
        model.load_adapter(folders[parts[1]], adapter_name=parts[1])
        model.set_adapter(list(parts))
        tuner = model.base_model
        read = tuner.prompt_for_use(parts).detach().float()  # [layers, 2, Hkv, 4 + N, hd], what our forward reads
        start = tuner.text_start(parts)
        assert adapter.positions == read.shape[-2] and start == sum(front.adapters[p].kv_start for p in parts)
        if start == read.shape[-2]:
            assert torch.equal(published, read) and adapter.folded_from is None
        else:
            assert adapter.folded_from == start == 4 + 7  # the whole cache folded as one, from 11 to 8
            assert torch.equal(published, fold_kv_prompt(read, front.base.config, start, read.shape[-2]))
        body = _served_body(llama, name)
        ids = front.token_ids(TEXT)
        assert body["prompt"] == [front.placeholder] * read.shape[-2] + ids
        assert body["kv_transfer_params"] == {VLLM_KV_PARAM: adapter.kv}
        assert body["cache_salt"] == front.salts.current(adapter.content)
        sub = {p: folders[p] for p in parts}
        engine, ours = _engine(llama["base"], published, ids), _ours(llama["base"], sub, list(parts), ids)
        assert engine[1] == ours[1] and (engine[0] - ours[0]).abs().max() < 1e-5
    finally:
        front.remove(name)


def test_compositions_name_loaded_kv_adapters_and_are_rebuilt_when_one_is_replaced(llama, tmp_path):
    front, folders = llama["front"], llama["folders"]
    for parts, words in [
        (["a", "gone"], r"\['gone'\] is not a loaded KV adapter"),
        (["a"], "two or more KV adapters"),
    ]:
        with pytest.raises(FrontError, match=words):
            front.compose("bad", parts)
    with pytest.raises(FrontError, match="`--compose` name .a. is taken: use a name no adapter has"):
        front.compose("a", ["a", "b"])
    front.compose("ab", ["a", "b"])
    try:
        with pytest.raises(FrontError, match=r"\['ab'\] is not a loaded KV adapter"):
            front.compose("nested", ["ab", "b"])
        with pytest.raises(FrontError, match=r"adapter 'a' is composed in \['ab'\]") as caught:
            front.remove("a")
        assert caught.value.status == 409
        before = front.adapters["ab"]
        other = _kv_adapter(llama["base"], tmp_path / "a2", seed=9, n=4)
        front.add("a", other)  # replaced: the composition now reads the new one
        after = front.adapters["ab"]
        assert after.kv != before.kv and after.parts == ("a", "b")
        expected = torch.cat([front.adapters["a"].kv_values, front.adapters["b"].kv_values], dim=-2)
        assert torch.equal(_published(llama, after), expected)
        assert _served_body(llama, "ab")["kv_transfer_params"] == {VLLM_KV_PARAM: after.kv}
    finally:
        front.remove("ab")
        front.add("a", folders["a"])
    assert "ab" not in front.compositions and "ab" not in front.adapters


def test_an_adapter_that_does_not_fit_the_engine_s_model_is_refused_at_load(llama, tmp_path):
    other_base = _save_llama(tmp_path / "tiny-llama", layers=3)  # the same folder name, another model
    misfit = _kv_adapter(other_base, tmp_path / "misfit", seed=4, n=4)
    files = set(llama["share"].iterdir())
    with pytest.raises(
        FrontError, match=r"doesn't fit the engine's model \(2 layers, 2 KV heads of size 16"
    ) as caught:
        llama["front"].add("misfit", misfit)
    assert "the KV prompt has 3 layers (the model: 2)" in str(caught.value) and caught.value.status == 400
    assert set(llama["share"].iterdir()) == files and "misfit" not in llama["front"].adapters


def test_a_folded_request_a_sliding_window_would_cut_otherwise_is_refused():
    """Mistral's window 8, N=4 folded from 6: a request of 2 positions reads what it read at 6; 3 would not
    (tests/files/test_fold.py measures both)."""
    config_name, kwargs = FAMILIES["mistral"]
    config = getattr(transformers, config_name)(vocab_size=300, **kwargs)
    adapter = Adapter("w", "w-folder", 4, "template", 4, "h", kv="h", folded_from=6)
    check_window(adapter, config, 2)
    with pytest.raises(FrontError, match=r"'w' is served folded from text start 6 to 4.*take 3 positions") as caught:
        check_window(adapter, config, 3)
    assert caught.value.status == 400 and "text_length <= 2" in str(caught.value)
    check_window(Adapter("n", "n-folder", 4, "template", 4, "h", kv="h"), config, 50)  # not folded: nothing to cut

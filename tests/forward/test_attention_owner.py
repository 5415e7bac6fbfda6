"""The one owner of the attention implementation (forward/attention_owner.py): unload hands back exactly what the
model had, whatever ran in between; a thread that runs another kernel (eager's weights for a KV student's start) runs
it for its own calls only. References: the implementation a fresh model names, the plain model's logits and
attention weights."""

import threading

import pytest
import torch
from peft import get_peft_model
from test_threads import _in_threads, switch_often  # noqa: F401 (the fixture)

from peft_softprompt_plus import SoftPromptPlusConfig
from peft_softprompt_plus.apps.tiny import tiny_family
from peft_softprompt_plus.distill import kv_start

VOCAB = 300
IDS = torch.randint(2, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


def _model(implementation, **config):
    base = tiny_family("llama", VOCAB)
    base.set_attn_implementation(implementation)
    model = get_peft_model(base, SoftPromptPlusConfig(num_virtual_tokens=4, init_seed=0, **config))
    model.add_adapter("kv", SoftPromptPlusConfig(num_virtual_tokens=5, prompt_level="kv", init_seed=1))
    return model


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_unload_hands_back_the_original_after_scores_a_concatenation_and_a_disabled_adapter(implementation):
    model = _model(implementation, forward_path="concat")
    base = model.get_base_model()
    kv_start.attention_scores(model, [5, 6, 7], [([8, 9], 0)], kv_heads=2)  # what a KV student's start runs
    with torch.no_grad():
        model(input_ids=IDS)  # the concatenated path
        model(input_ids=IDS, adapter_names=["kv", "kv"])  # the prompt at the attention
        with model.disable_adapter():
            assert base.config._attn_implementation == implementation
            model(input_ids=IDS)
        model(input_ids=IDS)
    assert model.base_model.forward_state.attention.original == implementation
    assert model.unload().config._attn_implementation == implementation


def test_a_switch_by_the_user_while_prompted_is_what_unload_hands_back():
    model = _model("sdpa")
    base = model.get_base_model()
    base.set_attn_implementation("eager")
    with torch.no_grad():
        model(input_ids=IDS)  # ours again, over the user's eager
    assert base.config._attn_implementation == "softprompt_plus_eager"
    assert model.unload().config._attn_implementation == "eager"


def test_running_another_kernel_needs_an_attached_enabled_adapter():
    model = _model("sdpa")
    owner = model.base_model.forward_state.attention
    with pytest.raises(ValueError, match="`kernel_name` must be one of"):
        with owner.running(model.get_base_model(), "flex_attention"):
            pass
    with model.disable_adapter(), pytest.raises(RuntimeError, match=r"outside `disable_adapter\(\)`"):
        with owner.running(model.get_base_model(), "eager"):
            pass


def test_one_thread_s_eager_scores_never_reach_another_thread_s_forward(switch_often):  # noqa: F811
    """While one thread reads eager's attention weights (a KV student's start), another thread's prompted forwards
    run the model's sdpa kernel with the same logits; the scores equal those of a model that is eager throughout."""
    model = _model("sdpa").eval()
    prefix, texts = [5, 6, 7, 8], [([9, 10, 11], 1)]
    reference = _model("eager").eval()
    want_scores = kv_start.attention_scores(reference, prefix, texts, kv_heads=2)
    with torch.no_grad():
        want = {name: model(input_ids=IDS, adapter_names=[name] * 2).logits for name in ("default", "kv")}
    wrong, stop = [], threading.Event()

    def work(i):
        if i == 0:
            for _ in range(40):
                if not torch.allclose(kv_start.attention_scores(model, prefix, texts, kv_heads=2), want_scores):
                    wrong.append("scores")
            stop.set()
            return
        name = ("default", "kv")[i - 1]
        while not stop.is_set():
            with torch.no_grad():
                got = model(input_ids=IDS, adapter_names=[name] * 2).logits
            kernels = model.base_model.forward_state.last_kernels
            if not torch.equal(got, want[name]) or not kernels <= {"sdpa_lower_right", "sdpa_mask"}:
                wrong.append((name, sorted(kernels)))

    assert _in_threads(work, 3) == []
    assert wrong == []
    assert model.get_base_model().config._attn_implementation == "softprompt_plus_sdpa"

"""One model called from several threads at once (forward/state.py's per-call state, generation.py's hook): each
call reads its own `adapter_names` and its own prompt, in forward and in `generate`, and each thread's exception fails
the test. `disable_adapter()` is the one switch every thread sees (documented in docs/many-tasks.md); a thread that
runs another kernel runs it alone (test_attention_owner.py)."""

import sys
import threading

import pytest
import torch
from peft import get_peft_model

from peft_softprompt_plus import SoftPromptPlusConfig
from peft_softprompt_plus.apps.tiny import tiny_family

VOCAB = 300


@pytest.fixture
def model():
    model = get_peft_model(tiny_family("llama", VOCAB), SoftPromptPlusConfig(num_virtual_tokens=4, init_seed=0))
    model.add_adapter("b", SoftPromptPlusConfig(num_virtual_tokens=6, init_seed=1))
    model.add_adapter("kv", SoftPromptPlusConfig(num_virtual_tokens=5, prompt_level="kv", init_seed=2))
    return model.eval()


@pytest.fixture
def switch_often():
    # A thread switch every microsecond: the window between one call setting its routing and reading it is open.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


ROUTES = [["default", "b"], ["b", "__base__"], ["kv", "default"], ["__base__", "kv"]]


def _in_threads(work, count: int) -> list:
    errors = []

    def run(i):
        try:
            work(i)
        except Exception as err:  # noqa: BLE001 - every failure is reported by the test
            errors.append(f"thread {i}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_threads_calling_one_model_each_read_their_own_adapter_names(model, switch_often):
    ids = torch.randint(2, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = [model(input_ids=ids, adapter_names=names).logits for names in ROUTES]
    wrong = []

    def work(i):
        for _ in range(60):
            with torch.no_grad():
                got = model(input_ids=ids, adapter_names=ROUTES[i]).logits
            if not torch.equal(got, want[i]):
                wrong.append(i)

    errors = _in_threads(work, len(ROUTES))
    assert errors == [] and wrong == []


def test_threads_generating_at_once_each_read_their_own_prompt(model, switch_often):
    ids = torch.randint(2, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=1)
    want = [model.generate(input_ids=ids, adapter_names=names, **settings) for names in ROUTES]
    wrong = []

    def work(i):
        for _ in range(8):
            if not torch.equal(model.generate(input_ids=ids, adapter_names=ROUTES[i], **settings), want[i]):
                wrong.append(i)

    errors = _in_threads(work, len(ROUTES))
    assert errors == [] and wrong == []
    assert model.get_base_model()._forward_pre_hooks.__len__() == 1  # one hook, installed at attach


def test_the_kernel_record_is_per_thread(model, switch_often):
    ids = torch.randint(2, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))  # > 8 queries: no split
    seen = {}

    def work(i):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.tensor([[1] * 12, [0] + [1] * 11]) if i else None)
        seen[i] = model.base_model.forward_state.last_kernels

    assert _in_threads(work, 2) == []
    assert seen == {0: frozenset({"sdpa_lower_right"}), 1: frozenset({"sdpa_mask"})}

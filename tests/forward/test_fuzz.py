"""Property tests (hypothesis): for any batch of rows with any lengths and left or right padding, the prompted
model's logits and greedy generations equal each row's run alone, on the attention path and mixed-adapter batches."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import get_peft_model

from peft_softprompt_plus import SoftPromptPlusConfig
from peft_softprompt_plus.apps.tiny import tiny_gpt2

SETTINGS = settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
rows = st.lists(st.lists(st.integers(2, 299), min_size=1, max_size=9), min_size=1, max_size=4)


@pytest.fixture(scope="module")
def model():
    model = get_peft_model(
        tiny_gpt2(initializer_range=0.5),
        SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, init_seed=0),
    )
    model.add_adapter("other", SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=5, init_seed=1))
    with torch.no_grad():
        for name in ("default", "other"):
            model.base_model.prompt(name).normal_()
    return model.eval()


def padded(batch: list[list[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in batch)
    ids = torch.ones(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(batch):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span], mask[i, span] = torch.tensor(row), 1
    return ids, mask


@SETTINGS
@given(batch=rows, left=st.booleans(), names=st.lists(st.sampled_from(["default", "other", "__base__"]), min_size=4))
def test_batched_logits_equal_one_by_one(model, batch, left, names):
    ids, mask = padded(batch, left)
    names = names[: len(batch)]
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, adapter_names=names).logits
        for i, row in enumerate(batch):
            alone = model(input_ids=torch.tensor([row]), adapter_names=[names[i]]).logits[0]
            torch.testing.assert_close(out[i][mask[i].bool()], alone, atol=1e-4, rtol=1e-4)


@SETTINGS
@given(batch=rows, names=st.lists(st.sampled_from(["default", "other"]), min_size=4))
def test_batched_greedy_generate_equals_one_by_one(model, batch, names):
    ids, mask = padded(batch, left=True)
    names = names[: len(batch)]
    out = model.generate(input_ids=ids, attention_mask=mask, adapter_names=names, max_new_tokens=4, do_sample=False)
    for i, row in enumerate(batch):
        alone = model.generate(
            input_ids=torch.tensor([row]), adapter_names=[names[i]], max_new_tokens=4, do_sample=False
        )
        assert out[i, ids.shape[1] :].tolist() == alone[0, len(row) :].tolist()

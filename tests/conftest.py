"""Shared fixtures: tiny seeded GPT-2 models and a local tokenizer; nothing touches the network."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from peft import get_peft_model  # noqa: E402

import peft_softprompt_plus  # noqa: E402,F401  (registers the method)
from peft_softprompt_plus import SoftPromptPlusConfig  # noqa: E402
from peft_softprompt_plus.apps.tiny import save_tiny, tiny_gpt2, tiny_tokenizer  # noqa: E402

# The tests mirror the package's layers, one folder each; a test may reuse another's reference by module name
# (`from test_families import reference_logits`) whichever folders a run collects.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _layer in sorted(os.listdir(_HERE)):
    if os.path.isdir(os.path.join(_HERE, _layer)) and not _layer.startswith(("_", ".")):
        sys.path.append(os.path.join(_HERE, _layer))


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # Tiny models gain nothing from intra-op threads, and on a shared CPU the spinning threads cost seconds.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def make_base():
    """`make_base(seed=0, task="CAUSAL_LM", **gpt2_config_overrides)` -> a fresh tiny GPT-2 in eval mode."""
    return tiny_gpt2


@pytest.fixture
def make_peft():
    """`make_peft(base=None, **SoftPromptPlusConfig kwargs)` -> PeftModel with a seeded 5-token prompt."""

    def _make(base=None, task_type="CAUSAL_LM", **config):
        base = base if base is not None else tiny_gpt2(task=task_type)
        config.setdefault("num_virtual_tokens", 5)
        config.setdefault("init_seed", 0)
        return get_peft_model(base, SoftPromptPlusConfig(task_type=task_type, **config))

    return _make


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny GPT-2 + tokenizer saved to disk, for `from_pretrained(path)` flows."""
    return save_tiny(str(tmp_path_factory.mktemp("tiny-gpt2")))


def random_ids(batch: int, length: int, vocab: int = 300, seed: int = 0) -> torch.Tensor:
    """Token ids that avoid the special ids 0 (end-of-text) and 1 (pad)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (batch, length), generator=g)


def prompt_tuning_reference(base, prompt: torch.Tensor, task: str = "CAUSAL_LM"):
    """The oracle most tests compare against: PEFT PROMPT_TUNING on `base` holding exactly `prompt`'s `[N, D]` values
    (float32, no dropout), in eval mode. Its logits are `[B, N+L, V]`: position N-1+i predicts text token i."""
    from peft import PromptTuningConfig

    ref = get_peft_model(base, PromptTuningConfig(task_type=task, num_virtual_tokens=prompt.shape[0]))
    with torch.no_grad():
        ref.prompt_encoder["default"].embedding.weight.copy_(prompt)
    return ref.eval()

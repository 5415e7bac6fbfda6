"""Precision: fp16, bf16, 8-bit and 4-bit bases with a float32 prompt: training, lowering after attach, saved
adapters that move between precisions, and no float32 copy of a low-precision base. Everything runs on the CPU."""

import importlib.util
import sys
import weakref
from pathlib import Path

import pytest
import torch
from conftest import random_ids
from peft import PeftModel, get_peft_model, prepare_model_for_kbit_training
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import BitsAndBytesConfig, GPT2LMHeadModel, Trainer, TrainingArguments

from peft_softprompt_plus import SoftPromptPlusConfig, check_gradient_flow

N = 5
SAVED_KEY = "base_model.softprompt_plus.prompt"


def _int8(path):
    quant = BitsAndBytesConfig(load_in_8bit=True)
    return GPT2LMHeadModel.from_pretrained(path, quantization_config=quant, device_map="cpu")


def _int4(path):
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    return GPT2LMHeadModel.from_pretrained(path, quantization_config=quant, device_map="cpu")


LOADERS = {
    "fp32": lambda path: GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32),
    "fp16": lambda path: GPT2LMHeadModel.from_pretrained(path, dtype=torch.float16),
    "bf16": lambda path: GPT2LMHeadModel.from_pretrained(path, dtype=torch.bfloat16),
    "int8": _int8,
    "int4": _int4,
}


def _attach(base):
    return get_peft_model(base, SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=N, init_seed=0))


def _prompt(model) -> torch.nn.Parameter:
    return model.base_model.prompt("default")


def _base_snapshot(model) -> dict:
    """Every base tensor (int8 row scales included) as (dtype, bytes, pointer, copy): a float32 master copy, an upcast
    or a write would all show."""
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    for name, module in model.named_modules():
        # bitsandbytes moves the int8 row scales from the weight to `module.state` at the first forward.
        # `__dict__`/`_parameters`, not getattr: PEFT tuner layers answer `.weight` through a property.
        scales = getattr(module.__dict__.get("state"), "SCB", None)
        scales = scales if scales is not None else getattr(module._parameters.get("weight"), "SCB", None)
        if scales is not None:
            tensors[f"{name}.SCB"] = scales
    return {n: (t.dtype, t.untyped_storage().nbytes(), t.data_ptr(), t.detach().clone()) for n, t in tensors.items()}


def _assert_same_base(before: dict, after: dict) -> None:
    assert after.keys() == before.keys()
    for name, (dtype, nbytes, ptr, values) in before.items():
        assert after[name][:3] == (dtype, nbytes, ptr), name
        assert torch.equal(after[name][3], values), name


def _train(model, ids, steps=5, lr=0.1, scaler=None, autocast_dtype=None) -> list[float]:
    """A manual Adam loop on one batch; returns the loss before each step and checks the float32 gradient each time."""
    prompt = _prompt(model)
    optimizer = torch.optim.Adam([prompt], lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            loss = model(input_ids=ids, labels=ids).loss
        (scaler.scale(loss) if scaler else loss).backward()
        assert prompt.grad.dtype == torch.float32 and prompt.is_leaf
        if scaler:
            scaler.unscale_(optimizer)  # raises "Attempting to unscale FP16 gradients" on an fp16 prompt
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert prompt.dtype == torch.float32
    return losses


def _assert_learns(losses: list[float]) -> None:
    assert losses[-1] < losses[0] - 0.02, losses
    assert all(b < a for a, b in zip(losses[:-1], losses[1:], strict=True)), losses


# ------------------------------------------------------------------------------------------------ fp16 / bf16


@pytest.mark.parametrize(
    "base_dtype, scaler, autocast_dtype",
    [
        pytest.param(torch.float16, True, None, id="fp16-gradscaler"),
        pytest.param(torch.bfloat16, False, None, id="bf16"),
        pytest.param(torch.float32, False, torch.bfloat16, id="fp32-autocast-bf16"),
    ],
)
def test_low_precision_training_keeps_a_float32_prompt(make_base, base_dtype, scaler, autocast_dtype):
    model = _attach(make_base().to(base_dtype))
    before = _base_snapshot(model.base_model.model)
    losses = _train(
        model, random_ids(4, 16), scaler=torch.amp.GradScaler("cpu") if scaler else None, autocast_dtype=autocast_dtype
    )
    _assert_learns(losses)
    assert model.get_input_embeddings().weight.dtype == base_dtype
    _assert_same_base(before, _base_snapshot(model.base_model.model))


def test_seq_cls_fp16_gradscaler_trains_a_float32_head_and_prompt(make_base):
    model = get_peft_model(
        make_base(task="SEQ_CLS", num_labels=2).half(),
        SoftPromptPlusConfig(task_type="SEQ_CLS", num_virtual_tokens=N, init_seed=0),
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in trainable} == {torch.float32}
    optimizer = torch.optim.Adam(trainable, lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    ids, labels = random_ids(4, 16), torch.tensor([0, 1, 0, 1])
    model.train()
    losses = []
    for _ in range(5):
        loss = model(input_ids=ids, labels=labels).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # unscales first: raises on fp16 gradients
        scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses  # not monotone: the scaler skips steps whose fp16 grads overflow


@pytest.mark.parametrize(
    "base_dtype, autocast_dtype, tolerance",
    [
        pytest.param(torch.float16, None, 5e-3, id="fp16"),
        pytest.param(torch.bfloat16, None, 3e-2, id="bf16"),
        pytest.param(torch.float32, torch.bfloat16, 3e-2, id="fp32-autocast-bf16"),
    ],
)
def test_low_precision_prompt_gradient_matches_fp32_reference(make_base, base_dtype, autocast_dtype, tolerance):
    ids = random_ids(4, 16)

    def grad(dtype, autocast):
        model = _attach(make_base().to(dtype)).train()
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return _prompt(model).grad

    reference, low = grad(torch.float32, None), grad(base_dtype, autocast_dtype)
    assert low.dtype == torch.float32
    assert ((low - reference).norm() / reference.norm()).item() < tolerance  # measured 7e-4 fp16, 5e-3 bf16


LOWERINGS = {
    "half": lambda m: m.half(),
    "bfloat16": lambda m: m.bfloat16(),
    "to-fp16": lambda m: m.to(torch.float16),
    "to-bf16-kw": lambda m: m.to(dtype=torch.bfloat16),
    "to-device-bf16": lambda m: m.to("cpu", torch.bfloat16),
}


@pytest.mark.parametrize("lower", list(LOWERINGS))
def test_lowering_after_attach_keeps_the_prompt_a_float32_leaf(make_base, lower):
    model = _attach(make_base())
    prompt = _prompt(model)
    optimizer = torch.optim.SGD([prompt], lr=1.0)  # built before lowering: it must still hold the live leaf
    LOWERINGS[lower](model)
    assert _prompt(model) is prompt and prompt.dtype == torch.float32 and prompt.is_leaf
    assert model.get_input_embeddings().weight.dtype in (torch.float16, torch.bfloat16)
    ids = random_ids(1, 4)
    start = prompt.detach().clone()
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert prompt.grad.dtype == torch.float32
    optimizer.step()
    assert not torch.equal(prompt.detach(), start)


@pytest.mark.parametrize("lower", ["half", "to-bf16-kw"])
def test_lowering_after_attach_keeps_the_prompt_values_exact(make_base, lower):
    model = _attach(make_base())
    start = _prompt(model).detach().clone()
    LOWERINGS[lower](model)
    assert torch.equal(_prompt(model).detach(), start)


# ------------------------------------------------------------------------------------------------ 8-bit / 4-bit


def test_int8_base_trains_on_cpu(tiny_model_dir):
    import bitsandbytes as bnb

    model = _attach(_int8(tiny_model_dir))
    base = model.base_model.model
    assert sum(isinstance(m, bnb.nn.Linear8bitLt) for m in base.modules()) == 4 * base.config.n_layer
    assert {p.dtype for p in base.parameters()} == {torch.int8, torch.float32}
    before = _base_snapshot(base)
    _assert_learns(_train(model, random_ids(4, 16)))
    _assert_same_base(before, _base_snapshot(base))


@pytest.mark.parametrize(
    "checkpointing",
    [
        pytest.param(None, id="default-reentrant"),  # the attach probe can't use autograd.grad here
        pytest.param({"use_reentrant": False}, id="non-reentrant"),
    ],
)
def test_int8_base_trains_after_prepare_model_for_kbit_training(tiny_model_dir, checkpointing):
    base = prepare_model_for_kbit_training(_int8(tiny_model_dir), gradient_checkpointing_kwargs=checkpointing)
    model = _attach(base)
    _assert_learns(_train(model, random_ids(2, 8), steps=3))


def test_int4_base_trains_on_cpu(tiny_model_dir):
    import bitsandbytes as bnb

    try:
        base = _int4(tiny_model_dir)
    except (ImportError, RuntimeError, ValueError, NotImplementedError) as err:
        pytest.skip(f"bitsandbytes {bnb.__version__} can't load a 4-bit model on this machine: {err}")
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in base.modules())
    model = _attach(base)
    before = _base_snapshot(base)
    _assert_learns(_train(model, random_ids(2, 8), steps=3))
    _assert_same_base(before, _base_snapshot(base))


# ------------------------------------------------------------------------------------------------ memory


class _FloatWeightCopies(TorchDispatchMode):
    """Peak bytes of float32/float64 tensors, born under this mode, that have the shape of a base weight."""

    def __init__(self, model):
        super().__init__()
        self.shapes = {s for p in model.parameters() if p.dim() == 2 for s in (tuple(p.shape), tuple(p.shape[::-1]))}
        self.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # views (`w.t()`) allocate nothing
        self.live = self.peak = 0
        self._alive = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if (
                isinstance(t, torch.Tensor)
                and t.dtype in (torch.float32, torch.float64)
                and tuple(t.shape) in self.shapes
            ):
                self._watch(t.untyped_storage())
        return out

    def _watch(self, storage):
        key = id(storage)  # a live storage keeps one Python object, so its id is stable until the weakref fires
        if key in self._alive or storage.data_ptr() in self.weights:
            return
        size = storage.nbytes()

        def freed(_ref, key=key, size=size):
            self._alive.pop(key, None)
            self.live -= size

        self._alive[key] = weakref.ref(storage, freed)
        self.live += size
        self.peak = max(self.peak, self.live)


@pytest.mark.parametrize("kind", ["fp16", "bf16", "int8"])
def test_no_float32_copy_of_a_low_precision_base(tiny_model_dir, kind):
    base = LOADERS[kind](tiny_model_dir)
    before = _base_snapshot(base)
    model = _attach(base)
    _assert_same_base(before, _base_snapshot(base))
    ids = random_ids(2, 7)  # 2*(1+7) and 4 prompt rows: no activation shares a weight's shape
    watcher = _FloatWeightCopies(base)
    with watcher:
        _train(model, ids, steps=1)
    _assert_same_base(before, _base_snapshot(base))
    if kind == "int8":
        # bitsandbytes' CPU training matmul (MatMul8bitFp) dequantizes one layer at a time: never the whole base.
        largest = max(p.numel() * 4 for p in base.parameters() if p.dtype == torch.int8)
        assert 0 < watcher.peak <= largest
    else:
        assert watcher.peak == 0


# ------------------------------------------------------------------------------------------------ portability


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """`trained(kind)` -> (adapter dir, trained model in eval mode, ids): 3 steps on a `kind` base, saved once."""
    cache = {}

    def get(kind):
        if kind not in cache:
            torch.manual_seed(0)
            model = _attach(LOADERS[kind](tiny_model_dir))
            ids = random_ids(4, 16, seed=1)
            _train(model, ids, steps=3)
            path = str(tmp_path_factory.mktemp(f"adapter-{kind}"))
            model.save_pretrained(path)
            cache[kind] = (path, model.eval(), ids)
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", ["int8", "fp16"])
def test_saved_prompt_is_float32(trained, kind):
    path, model, _ = trained(kind)
    saved = load_file(f"{path}/adapter_model.safetensors")
    assert set(saved) == {SAVED_KEY}
    assert saved[SAVED_KEY].dtype == torch.float32
    assert torch.equal(saved[SAVED_KEY], _prompt(model).detach())


@torch.no_grad()
def _logits(model, ids) -> torch.Tensor:
    return model(input_ids=ids).logits.float()  # [B, L, V]


@pytest.mark.parametrize("source, target", [("int8", "fp32"), ("int8", "fp16"), ("fp16", "fp32"), ("fp32", "int8")])
def test_adapter_moves_between_precisions(tiny_model_dir, trained, source, target):
    path, trained_model, ids = trained(source)
    loaded = PeftModel.from_pretrained(LOADERS[target](tiny_model_dir), path).eval()
    assert _prompt(loaded).dtype == torch.float32
    assert torch.equal(_prompt(loaded), _prompt(trained_model))
    diff = (_logits(loaded, ids) - _logits(trained_model, ids)).abs().max()
    # Reference: how far the two bare bases already disagree. The prompt must add no error of its own.
    with loaded.disable_adapter(), trained_model.disable_adapter():
        base_noise = (_logits(loaded, ids) - _logits(trained_model, ids)).abs().max()
    with loaded.disable_adapter():
        effect = (_logits(loaded, ids) - _logits(trained_model, ids)).abs().max()
    assert diff <= 2 * base_noise + 1e-6, (diff.item(), base_noise.item())
    assert effect > 20 * diff  # the comparison sees the prompt: dropping it moves the logits far more than noise


# ------------------------------------------------------------------------------------------------ Trainer


def test_trainer_bf16_on_cpu_trains_a_float32_prompt(make_base, tmp_path):
    model = _attach(make_base())
    prompt = _prompt(model)
    start = prompt.detach().clone()
    ids = random_ids(4, 12)
    rows = [{"input_ids": row, "labels": row} for row in ids]
    head_dtypes = set()
    model.base_model.model.lm_head.register_forward_hook(lambda mod, args, out: head_dtypes.add(out.dtype))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        bf16=True,
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=6,
        learning_rate=0.1,
        lr_scheduler_type="constant",
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    assert trainer.accelerator.mixed_precision == "bf16"  # unlike fp16=True on the CPU, which is silently dropped
    assert head_dtypes == {torch.bfloat16}
    assert _prompt(model) is prompt and prompt.dtype == torch.float32
    assert not torch.equal(prompt.detach(), start)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0] - 0.02, losses


# ------------------------------------------------------------------------------------------------ bad input


def test_prompt_forced_to_fp16_is_reported(make_base):
    model = _attach(make_base().half())
    assert "low_precision_prompt" not in {f.code for f in check_gradient_flow(model).findings}  # float32: healthy
    prompt = _prompt(model)
    prompt.data = prompt.data.half()  # by hand, past the bank's guard
    assert "low_precision_prompt" in {f.code for f in check_gradient_flow(model).findings}


# ------------------------------------------------------------------------------------------------ GPU script


def test_cuda_check_exits_with_a_message_without_cuda(monkeypatch, capsys):
    path = Path(__file__).resolve().parents[2] / "bench" / "cuda_check.py"
    spec = importlib.util.spec_from_file_location("cuda_check", path)
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "cuda_check", script)  # its dataclasses look their module up there
    spec.loader.exec_module(script)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        script.main([])
    assert exit_info.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ KV prompts


@pytest.mark.parametrize("kind", ["fp16", "bf16", "int8", "int4"])
def test_a_kv_prompt_stays_float32_and_trains_on_every_base(tiny_model_dir, kind):
    """The keys/values are cast to the base's dtype where the attention reads them; the leaf and its gradient stay
    float32 (GradScaler's unscale refuses anything else), and the base is untouched."""
    import bitsandbytes as bnb

    try:
        base = LOADERS[kind](tiny_model_dir)
    except (ImportError, RuntimeError, ValueError, NotImplementedError) as err:
        pytest.skip(f"bitsandbytes {bnb.__version__} can't load a {kind} model on this machine: {err}")
    before = _base_snapshot(base)
    config = SoftPromptPlusConfig(num_virtual_tokens=N, prompt_level="kv", init_seed=0, kv_frozen_positions=1)
    model = get_peft_model(base, config)
    bank = model.base_model.prompt_bank
    assert {p.dtype for p in bank.parameters()} == {torch.float32}
    scaler = torch.amp.GradScaler("cpu") if kind == "fp16" else None
    _assert_learns(_train(model, random_ids(2, 8), steps=3, scaler=scaler))
    assert bank.sinks["default"].dtype == torch.float32
    _assert_same_base(before, _base_snapshot(base))

"""bench/cuda_check.py's attention part (needs CUDA): the SDPA backend our prompt attention runs, bf16 exactness
against the concatenation and PEFT PROMPT_TUNING, and step time + peak memory of ours / PEFT / the floor on random
Llamas of SmolLM2-135M's and Llama-3.2-1B's shapes, L = 512-8192, N = 20 and 100, checkpointing off and on."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from _stats import markdown_header, markdown_row
from peft import PromptTuningConfig, get_peft_model
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

from peft_softprompt_plus import SoftPromptPlusConfig

SHAPES = {  # name -> (LlamaConfig arguments, tokens per step)
    "smollm2-135m": (
        dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
             intermediate_size=1536, vocab_size=49152, rope_theta=100000.0),
        16384,
    ),
    "llama-1b": (
        dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=8192, vocab_size=128256, rope_theta=500000.0),
        8192,
    ),
}  # fmt: skip
LENGTHS, NS, DEV, VOCAB_DRAW = (512, 2048, 8192), (20, 100), "cuda", 40000


def smoke_on_cpu() -> None:
    """`--device cpu --quick`: the same code on tiny shapes, to check the script itself without a GPU."""
    global DEV, LENGTHS, NS, VOCAB_DRAW, SHAPES
    DEV, LENGTHS, NS, VOCAB_DRAW = "cpu", (32, 64), (4,), 200
    tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=256)  # fmt: skip
    SHAPES = {"tiny-llama": (tiny, 128)}


@dataclass
class Timing:
    ms: float
    peak_mb: float


def _base(shape: str, state=None) -> LlamaForCausalLM:
    config = LlamaConfig(
        **SHAPES[shape][0], max_position_embeddings=8192 + 128, tie_word_embeddings=True, attn_implementation="sdpa"
    )
    with torch.device(DEV):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    if state is not None:
        model.load_state_dict(state)
    return model.train()


def _checkpointing(model, on: bool) -> None:
    if on and hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.24
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _time(step, reps: int) -> Timing:
    step()
    step()  # warm-up: kernels chosen, allocator grown
    _sync()
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20 if DEV == "cuda" else 0.0
    return Timing(1000 * sorted(times)[len(times) // 2], peak)


def _step(model, ids, params):
    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for p in params:
            p.grad = None

    return step


def _floor(base, ids):
    base.requires_grad_(False)
    embed = base.get_input_embeddings()

    def step():
        x = embed(ids).detach()  # the frozen embedding's output, a leaf, as a prompt's gradient would need
        base(inputs_embeds=x.requires_grad_(), labels=ids).loss.backward()

    return step


def backend_and_exactness(shape: str, state) -> list[str]:
    """Flash only: our no-padding forward and backward must run with the flash kernel alone (a mask tensor would make
    SDPA refuse it). bf16 loss against the concatenation and PEFT with the same prompt values."""
    lines = []
    ids = torch.randint(2, VOCAB_DRAW, (4, LENGTHS[0]), device=DEV, generator=torch.Generator(DEV).manual_seed(0))
    ours = get_peft_model(_base(shape, state), SoftPromptPlusConfig(num_virtual_tokens=20, init_seed=0))
    flash_only = [SDPBackend.FLASH_ATTENTION] if DEV == "cuda" else [SDPBackend.MATH]
    try:
        with sdpa_kernel(flash_only):
            loss = ours(input_ids=ids, labels=ids).loss
            loss.backward()
        kernels = sorted(ours.base_model.forward_state.last_kernels)
        lines.append(f"PASS flash only, training: forward+backward ran, kernels {kernels}, loss {loss.item():.4f}")
        with sdpa_kernel(flash_only), torch.no_grad():
            ours(input_ids=ids, labels=ids)
        kernels = sorted(ours.base_model.forward_state.last_kernels)
        lines.append(f"PASS flash only, no_grad (the prompt at the attention): ran, kernels {kernels}")
    except RuntimeError as err:
        lines.append(f"MISS flash only: {str(err).splitlines()[0][:200]}")
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    try:
        with sdpa_kernel(flash_only):
            ours(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        lines.append("info left padding under flash only: ran")
    except RuntimeError as err:
        lines.append(f"info left padding under flash only: refused as expected (explicit mask): {str(err)[:80]}")
    prompt = ours.base_model.prompt("default").detach()
    with torch.no_grad():
        ours_loss = ours(input_ids=ids, labels=ids).loss.float()
        concat = get_peft_model(
            _base(shape, state), SoftPromptPlusConfig(num_virtual_tokens=20, init_seed=0, forward_path="concat")
        )
        concat.base_model.prompt("default").copy_(prompt)
        concat_loss = concat(input_ids=ids, labels=ids).loss.float()
        peft = get_peft_model(_base(shape, state), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=20))
        peft.prompt_encoder["default"].embedding.weight.copy_(prompt)
        peft_loss = peft(input_ids=ids, labels=ids).loss.float()
    worst = max(abs(ours_loss - concat_loss).item(), abs(ours_loss - peft_loss).item())
    verdict = "PASS" if worst <= 2e-2 else "MISS"
    lines.append(
        f"{verdict} bf16 loss: ours {ours_loss.item():.5f}, concatenation {concat_loss.item():.5f}, PEFT "
        f"{peft_loss.item():.5f} (|diff| <= 2e-2)"
    )
    return lines


def flash_attention_2(shape: str, state) -> list[str]:
    """A model loaded with `flash_attention_2` keeps flash while attached (forward/flash.py): with flash-attn
    installed, a left-padded batch and a mixed-adapter batch run flash-attn's varlen kernel and equal the sdpa path
    in bf16."""
    import importlib.util

    if DEV != "cuda" or importlib.util.find_spec("flash_attn") is None:
        return ["info flash_attention_2: flash-attn not installed here; tests/forward/test_flash.py checks the path "
                "against a pure-torch stand-in on the CPU"]  # fmt: skip
    ids = torch.randint(2, VOCAB_DRAW, (4, LENGTHS[0]), device=DEV, generator=torch.Generator(DEV).manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    logits, kernels = {}, {}
    for implementation in ("flash_attention_2", "sdpa"):
        base = _base(shape, state)
        base.set_attn_implementation(implementation)
        model = get_peft_model(base, SoftPromptPlusConfig(num_virtual_tokens=20, init_seed=0)).eval()
        model.add_adapter("other", SoftPromptPlusConfig(num_virtual_tokens=12, init_seed=1))
        with torch.no_grad():
            padded = model(input_ids=ids, attention_mask=mask).logits.float()
            mixed = model(input_ids=ids, adapter_names=["default", "other", "__base__", "other"]).logits.float()
        logits[implementation] = padded, mixed
        kernels[implementation] = sorted(model.base_model.forward_state.last_kernels)
    real = mask.bool()
    worst = max(
        (logits["flash_attention_2"][0][real] - logits["sdpa"][0][real]).abs().max().item(),
        (logits["flash_attention_2"][1] - logits["sdpa"][1]).abs().max().item(),
    )
    verdict = "PASS" if kernels["flash_attention_2"] == ["flash_varlen"] and worst <= 0.25 else "MISS"
    return [f"{verdict} flash_attention_2 kept: kernels {kernels['flash_attention_2']}, max |logit diff| vs sdpa "
            f"{worst:.3f} (bf16, <= 0.25)"]  # fmt: skip


def speed(shape: str, state, deadline: float, reps: int) -> list[dict]:
    rows = []
    tokens = SHAPES[shape][1]
    for n in NS:
        for length in LENGTHS:
            for ckpt in (False, True):
                if time.time() > deadline:
                    return rows
                batch = max(1, tokens // length)
                ids = torch.randint(2, VOCAB_DRAW, (batch, length), device=DEV)
                row = {"shape": shape, "N": n, "L": length, "B": batch, "ckpt": ckpt}
                ours = get_peft_model(_base(shape, state), SoftPromptPlusConfig(num_virtual_tokens=n, init_seed=0))
                _checkpointing(ours.get_base_model(), ckpt)
                row["ours"] = _time(_step(ours, ids, [ours.base_model.prompt("default")]), reps)
                row["kernels"] = "+".join(sorted(ours.base_model.forward_state.last_kernels))
                del ours
                peft = get_peft_model(
                    _base(shape, state), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=n)
                )
                _checkpointing(peft.get_base_model(), ckpt)
                row["peft"] = _time(_step(peft, ids, [peft.prompt_encoder["default"].embedding.weight]), reps)
                del peft
                floor = _base(shape, state)
                _checkpointing(floor, ckpt)
                row["floor"] = _time(_floor(floor, ids), reps)
                del floor
                if DEV == "cuda":
                    torch.cuda.empty_cache()
                rows.append(row)
                print(_line(row), flush=True)
    return rows


def _line(r: dict) -> str:
    ours, peft, floor = r["ours"], r["peft"], r["floor"]
    return markdown_row([
        r["shape"], r["N"], r["L"], r["B"], "on" if r["ckpt"] else "off", f"{ours.ms:.1f}", f"{peft.ms:.1f}",
        f"{floor.ms:.1f}", f"{peft.ms / ours.ms:.3f}", f"{ours.ms / floor.ms:.3f}",
        f"{ours.peak_mb:.0f} / {peft.peak_mb:.0f} / {floor.peak_mb:.0f}", r["kernels"],
    ])  # fmt: skip


HEADER = markdown_header([
    "shape", "N", "L", "B", "ckpt", "ours ms", "PEFT ms", "floor ms", "PEFT / ours", "ours / floor",
    "peak MB ours / PEFT / floor", "our kernels",
])  # fmt: skip


def verdicts(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        ours, peft, floor = r["ours"].ms, r["peft"].ms, r["floor"].ms
        tag = f"{r['shape']} N={r['N']} L={r['L']} ckpt={'on' if r['ckpt'] else 'off'}"
        out.append(f"{'PASS' if ours / floor <= 1.25 else 'MISS'} ours/floor {ours / floor:.3f} <= 1.25 ({tag})")
        want = 1.5 if r["N"] == 100 and r["L"] <= 2048 else 1.0
        out.append(f"{'PASS' if peft / ours >= want else 'MISS'} PEFT/ours {peft / ours:.3f} >= {want} ({tag})")
    return out


def run(seconds: float, reps: int, shapes=None) -> int:
    deadline = time.time() + seconds
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke run)"
    print(f"torch {torch.__version__}, transformers {__import__('transformers').__version__}, {name}", flush=True)
    all_rows, checks = [], []
    for shape in shapes or tuple(SHAPES):
        state = {k: v.clone() for k, v in _base(shape).state_dict().items()}
        lines = backend_and_exactness(shape, state) + flash_attention_2(shape, state)
        checks += [f"[{shape}] {line}" for line in lines]
        print("\n".join(checks[-4:]) + "\n" + HEADER, flush=True)
        all_rows += speed(shape, state, deadline, reps)
        del state
        if DEV == "cuda":
            torch.cuda.empty_cache()
    print("\n" + HEADER)
    for r in all_rows:
        print(_line(r))
    results = checks + verdicts(all_rows)
    print("\n" + "\n".join(results))
    return 0 if all(not line.startswith("MISS") for line in results) else 1


def profile(shape: str = "smollm2-135m", length: int = 2048, n: int = 20, top: int = 15) -> None:
    """Where a train step's GPU time goes, ours against PEFT and the floor: the top kernels by CUDA time, and the
    CPU time of the step (a launch-bound step shows CPU time near its wall time)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    state = {k: v.clone() for k, v in _base(shape).state_dict().items()}
    batch = max(1, SHAPES[shape][1] // length)
    ids = torch.randint(2, VOCAB_DRAW, (batch, length), device=DEV)
    ours = get_peft_model(_base(shape, state), SoftPromptPlusConfig(num_virtual_tokens=n, init_seed=0))
    peft = get_peft_model(_base(shape, state), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=n))
    floor = _base(shape, state)
    steps = {
        "ours": _step(ours, ids, [ours.base_model.prompt("default")]),
        "peft": _step(peft, ids, [peft.prompt_encoder["default"].embedding.weight]),
        "floor": _floor(floor, ids),
    }
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
    for name, step in steps.items():
        step()
        step()
        _sync()
        with torch_profile(activities=activities) as prof:
            for _ in range(3):
                step()
            _sync()
        sort = "self_cuda_time_total" if DEV == "cuda" else "self_cpu_time_total"
        print(f"\n== {name} ({shape}, B={batch}, L={length}, N={n}; 3 steps)", flush=True)
        print(prof.key_averages().table(sort_by=sort, row_limit=top, max_name_column_width=60), flush=True)

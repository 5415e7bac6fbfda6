"""The lm-eval recipe: lm-evaluation-harness's unchanged CLI scores a soft-prompt adapter when started as
`softprompt-plus run -- lm_eval --model hf --model_args pretrained=BASE,peft=ADAPTER ...`, and fails without it.

A tiny GPT-2 and an adapter with a strong, distinct prompt are saved to disk; two local tasks (a multiple-choice
task scored by log-likelihood and a greedy generate_until task) read a jsonl written next to them. What lm-eval logs
per sample (`--log_samples`) is checked against the library called directly: the same (context, continuation) token
split lm-eval makes, summed log-probabilities, and `model.generate` one prompt at a time (lm-eval batches and
left-pads generation, right-pads log-likelihood batches and calls the model without an attention mask).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from peft_softprompt_plus import SoftPromptPlusConfig
from peft_softprompt_plus.apps.cli import STARTUP_DIR
from peft_softprompt_plus.apps.tiny import save_tiny

pytest.importorskip("lm_eval")

pytestmark = pytest.mark.slow  # every test starts lm_eval (tens of seconds on 2 cores)

NUM_VIRTUAL_TOKENS = 4
MAX_GEN_TOKS = 6
TOLERANCE = 1e-4
# Contexts of different token lengths, so batches of 4 are padded (right for log-likelihood, left for generation).
DOCS = [
    {"question": "one two three", "choices": ["four", "five", "cat dog"], "answer": 0},
    {"question": "red green blue", "choices": ["yellow", "horse", "the lazy dog"], "answer": 0},
    {"question": "the quick brown fox", "choices": ["jumps over", "sheep", "ten"], "answer": 0},
    {"question": "hello world this is a tiny", "choices": ["model for tests", "purple", "good bad"], "answer": 0},
    {"question": "cat", "choices": ["dog bird fish", "seven eight", "white"], "answer": 0},
    {"question": "a soft prompt is a learned", "choices": ["sequence of input", "goat", "six"], "answer": 0},
]
MC_TASK = """\
task: spp_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """\
task: spp_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["<never>"]
  do_sample: false
  max_gen_toks: {max_gen_toks}
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def _env(tmp: Path) -> dict:
    """Offline, one thread, the venv's `bin` first on PATH (`run` finds `lm_eval` there) and no inherited PYTHONPATH
    (so an outer `softprompt-plus run` can't register the method for the runs that must go without it)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp / "datasets-cache"),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _lm_eval_args(setup: dict, tasks: str, batch_size: int, out: Path) -> list[str]:
    model_args = f"pretrained={setup['base']},peft={setup['adapter']},dtype=float32"
    return ["--model", "hf", "--model_args", model_args, "--tasks", tasks, "--include_path", str(setup["tasks"]),
            "--batch_size", str(batch_size), "--device", "cpu", "--output_path", str(out),
            "--log_samples"]  # fmt: skip


def _samples(out: Path, task: str) -> list[dict]:
    (path,) = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    with open(path, encoding="utf-8") as handle:
        return sorted((json.loads(line) for line in handle), key=lambda s: s["doc_id"])


def _run_recipe(setup: dict, batch_size: int) -> dict:
    out = setup["tmp"] / f"out-bs{batch_size}"
    command = [sys.executable, "-m", "peft_softprompt_plus.apps.cli", "run", "--", "lm_eval"]
    done = subprocess.run(command + _lm_eval_args(setup, "spp_mc,spp_gen", batch_size, out), env=setup["env"],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return {"mc": _samples(out, "spp_mc"), "gen": _samples(out, "spp_gen")}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lm-eval")
    base = save_tiny(str(tmp / "base"))
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=NUM_VIRTUAL_TOKENS, init_seed=0),
    )
    with torch.no_grad():  # distinct, nonzero and far larger than the tiny model's embeddings: it must show
        prompt = torch.randn(NUM_VIRTUAL_TOKENS, model.config.n_embd, generator=torch.Generator().manual_seed(1))
        model.base_model.prompt("default").copy_(2.0 * prompt)
    adapter = tmp / "adapter"
    model.save_pretrained(adapter)

    tasks = tmp / "tasks"
    tasks.mkdir()
    data = tasks / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS), encoding="utf-8")
    (tasks / "spp_mc.yaml").write_text(MC_TASK.format(data=data), encoding="utf-8")
    (tasks / "spp_gen.yaml").write_text(GEN_TASK.format(data=data, max_gen_toks=MAX_GEN_TOKS), encoding="utf-8")
    return {"tmp": tmp, "base": base, "adapter": str(adapter), "tasks": tasks, "env": _env(tmp)}


@pytest.fixture(scope="module")
def batched(setup):
    return _run_recipe(setup, batch_size=4)


@pytest.fixture(scope="module")
def unbatched(setup):
    return _run_recipe(setup, batch_size=1)


@pytest.fixture(scope="module")
def models(setup):
    tokenizer = AutoTokenizer.from_pretrained(setup["base"])
    base = AutoModelForCausalLM.from_pretrained(setup["base"]).eval()
    prompted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(setup["base"]), setup["adapter"])
    return tokenizer, base, prompted.eval()


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split for causal models (`TemplateLM._encode_pair`): trailing spaces of the context move to the
    continuation, the whole string is encoded and the continuation is what follows the context's own tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return context_ids, whole[len(context_ids) :]


@torch.no_grad()
def _loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    context_ids, continuation_ids = _encode_pair(tokenizer, context, continuation)
    ids = torch.tensor([(context_ids + continuation_ids)[:-1]])
    logits = model(input_ids=ids).logits[0, -len(continuation_ids) :]  # the last positions predict the continuation
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(continuation_ids)
    return logprobs.gather(-1, target[:, None]).sum().item(), bool((logits.argmax(-1) == target).all())


def _requests(sample: dict) -> list[tuple[str, str]]:
    return [(args["arg_0"], args["arg_1"]) for args in sample["arguments"].values()]


def _scores(sample: dict) -> list[tuple[float, bool]]:
    return [(float(value), flag == "True") for value, flag in sample["filtered_resps"]]


def test_loglikelihoods_equal_the_library_and_the_prompt_is_applied(batched, models):
    tokenizer, base, prompted = models
    assert len(batched["mc"]) == len(DOCS)
    worst, moved = 0.0, []
    for sample, doc in zip(batched["mc"], DOCS, strict=True):
        requests = _requests(sample)
        assert requests == [(doc["question"], " " + choice) for choice in doc["choices"]]
        for (context, continuation), (score, greedy) in zip(requests, _scores(sample), strict=True):
            expected, expected_greedy = _loglikelihood(prompted, tokenizer, context, continuation)
            worst = max(worst, abs(score - expected))
            assert greedy == expected_greedy
            moved.append(abs(score - _loglikelihood(base, tokenizer, context, continuation)[0]))
    print(f"max |lm-eval - library| log-likelihood: {worst:.3g}; min |with - without prompt|: {min(moved):.3g}")
    assert worst < TOLERANCE
    assert min(moved) > 10 * TOLERANCE  # every score moved: lm-eval ran the prompt, not the bare base model


def test_batch_sizes_1_and_4_give_the_same_results(batched, unbatched):
    for task in ("mc", "gen"):
        for one, four in zip(unbatched[task], batched[task], strict=True):
            assert one["arguments"] == four["arguments"]
            if task == "gen":
                assert one["filtered_resps"] == four["filtered_resps"]
            else:
                for (a, greedy_a), (b, greedy_b) in zip(_scores(one), _scores(four), strict=True):
                    assert abs(a - b) < TOLERANCE and greedy_a == greedy_b


@torch.no_grad()
def _generate(model, tokenizer, context: str) -> tuple[str, int]:
    """Greedy `generate` on one unpadded prompt, decoded the way lm-eval decodes (special tokens skipped), and the
    number of new tokens."""
    ids = tokenizer(context, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=MAX_GEN_TOKS, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    new = out[0, ids["input_ids"].shape[1] :]
    return tokenizer.decode(new, skip_special_tokens=True), len(new)


def test_generate_until_equals_the_library_generate(batched, models):
    """lm-eval left-pads a batch of 4 contexts of different lengths and calls `PeftModel.generate` with
    `max_length` = padded length + max_gen_toks; the library, one unpadded prompt at a time, must agree."""
    tokenizer, base, prompted = models
    assert len(batched["gen"]) == len(DOCS)
    differs = 0
    for sample, doc in zip(batched["gen"], DOCS, strict=True):
        (text,) = sample["filtered_resps"]
        expected, new_tokens = _generate(prompted, tokenizer, doc["question"])
        assert text == expected, doc["question"]
        assert new_tokens == MAX_GEN_TOKS  # no early stop: lm-eval's max_length left room for all (no virtual token)
        differs += text != _generate(base, tokenizer, doc["question"])[0]
    assert differs > 0  # the prompt changed what was generated


def test_plain_lm_eval_cannot_load_the_adapter(setup):
    """What the wrapper fixes. lm-eval's own entry point in a clean interpreter: `-S` skips every .pth start-up hook
    (`softprompt-plus autoload on` writes one) and sitecustomize, and `run`'s start-up folder is off the path."""
    path = [p for p in sys.path if p and os.path.abspath(p) != STARTUP_DIR]
    code = (
        f"import sys; sys.path[:] = {path!r}\n"
        "from lm_eval.__main__ import cli_evaluate\n"
        "sys.argv = ['lm_eval'] + sys.argv[1:]\n"
        "sys.exit(cli_evaluate())\n"
    )
    args = _lm_eval_args(setup, "spp_mc", 4, setup["tmp"] / "out-plain")
    done = subprocess.run([sys.executable, "-S", "-c", code, *args], env=setup["env"], capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode != 0
    assert "KeyError: 'SOFTPROMPT_PLUS'" in done.stderr, done.stderr[-4000:]

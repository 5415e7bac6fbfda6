"""Checks the KV connector (`peft_softprompt_plus.integrations.vllm_kv`) offline on vLLM for CPU: tiny GPT-2 (MHA)
and Llama (GQA) models (or the real SmolLM2), seeded `vocab` input adapters lifted exactly to KV and published as the
front publishes them, and vLLM's greedy tokens through the connector compared with the input adapter through
`prompt_embeds` (the oracle) and with this library's own `generate` on the KV adapter. Also: mixed adapters in one
batch, a repeat (prefix cache hits), and chunked prefill with preemption under a tiny cache. Not in the test suite.

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/vllm/_vllm_kv_check.py [--out DIR] [--families gpt2 llama]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
PLACEHOLDER = 0  # any id: the connector fills these positions, only the prefix cache's block hashes see it
NEW_TOKENS = 16
BLOCK = 32  # the CPU backend takes multiples of 32; small so that repeats hit the prefix cache
SIZES = (10, 20, 40)  # none a multiple of BLOCK; 40 spans two blocks
TEXTS = [
    "red green blue",
    "the quick brown fox jumps over the lazy dog",
    "cat dog bird fish horse cow sheep goat red green blue yellow black white orange purple one two three four",
    "a soft prompt is a learned sequence of input embeddings gradients flow from the loss back to the prompt "
    "through the frozen model hello world this is a tiny model for tests",
]


def _connector(share: str) -> dict:
    from peft_softprompt_plus.serve.kv_fields import vllm_config

    return json.loads(vllm_config(share))


def _save_model(family: str, path: str) -> str:
    """A tiny seeded model saved with the tiny tokenizer, or `smollm2`: the real SmolLM2-135M-Instruct (GQA 9/3)."""
    import torch
    import transformers

    from peft_softprompt_plus import fetch_checkpoint
    from peft_softprompt_plus.apps.tiny import tiny_tokenizer

    if family == "smollm2":
        return fetch_checkpoint("smollm2")
    tokenizer = tiny_tokenizer()
    ids = dict(bos_token_id=0, eos_token_id=0, pad_token_id=1, initializer_range=0.2)  # wide enough to vary tokens
    configs = {  # head size 32: the smallest the CPU attention kernels take
        "gpt2": ("GPT2Config", dict(n_embd=128, n_layer=2, n_head=4, n_positions=256, **ids)),
        "llama": (
            "LlamaConfig",
            dict(
                hidden_size=128,
                intermediate_size=256,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=256,
                **ids,
            ),
        ),
    }
    name, kwargs = configs[family]
    config = getattr(transformers, name)(vocab_size=len(tokenizer), **kwargs)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_llama(out: str, chat_template: str) -> str:
    """The tiny Llama (with a chat template) saved under `out`, its path; greedy replies never end on a partial
    character."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _save_model("llama", os.path.join(out, "llama-tp"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    # Replies are compared as text: a byte that isn't a character alone (byte-level BPE) decodes to U+FFFD, and
    # vLLM's incremental detokenizer holds such bytes back. Their output rows zeroed (logit 0, below the largest of
    # ~250 random logits), the greedy reply never holds one, and equal text means equal tokens.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    partial = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i]) or i == tokenizer.pad_token_id]
    with torch.no_grad():
        model.lm_head.weight[partial] = 0
    model.save_pretrained(path)
    return path


def _adapters(model_path: str, out: str) -> dict[int, tuple[str, str]]:
    """N -> (input adapter, its exact KV lift), seeded `vocab` rows."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from peft_softprompt_plus import SoftPromptPlusConfig

    folders = {}
    for n in SIZES:
        base = AutoModelForCausalLM.from_pretrained(model_path)
        folder_in, folder_kv = os.path.join(out, f"input{n}"), os.path.join(out, f"kv{n}")
        config = SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=n, prompt_init="vocab", init_seed=n)
        get_peft_model(base, config).save_pretrained(folder_in)
        lift = SoftPromptPlusConfig(
            task_type="CAUSAL_LM",
            prompt_level="kv",
            num_virtual_tokens=n,
            prompt_init="adapter",
            prompt_init_adapter=folder_in,
        )
        get_peft_model(AutoModelForCausalLM.from_pretrained(model_path), lift).save_pretrained(folder_kv)
        folders[n] = (folder_in, folder_kv)
    return folders


def _until_eos(row: list[int], eos: int = 0) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row


def _references(model_path: str, folders: dict, ids: list[list[int]]):
    """Per N: the input adapter's `[N+L, D]` prompt_embeds rows, and the library's greedy tokens with the KV one."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from peft_softprompt_plus import prompt_embeds

    rows, library = {}, {}
    with torch.no_grad():
        for n, (folder_in, folder_kv) in folders.items():
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path), folder_in).eval()
            rows[n] = [prompt_embeds(model, torch.tensor(row))[0].cpu() for row in ids]
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path), folder_kv).eval()
            library[n] = []
            for row in ids:
                out = model.generate(input_ids=torch.tensor([row]), max_new_tokens=NEW_TOKENS, do_sample=False)
                library[n].append(_until_eos(out[0, len(row) :].tolist()))
    return rows, library


def _kv_requests(folders: dict, ids: list[list[int]], share: str):
    """One request per (N, text) through the connector (each KV adapter published to `share` as the front does), and
    one per text without an adapter."""
    from vllm import SamplingParams

    from peft_softprompt_plus._names import VLLM_KV_PARAM
    from peft_softprompt_plus.files.inspect_adapter import read_adapter
    from peft_softprompt_plus.serve.share import publish

    prompts, params, keys = [], [], []
    for n, (_, folder_kv) in folders.items():
        digest = publish(share, *read_adapter(folder_kv))
        extra = {"kv_transfer_params": {VLLM_KV_PARAM: digest}}
        for i, row in enumerate(ids):
            prompts.append({"prompt_token_ids": [PLACEHOLDER] * n + row, "cache_salt": digest})
            params.append(SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=1, extra_args=extra))
            keys.append((n, i))
    for i, row in enumerate(ids):
        prompts.append({"prompt_token_ids": row})
        params.append(SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=1))
        keys.append(("base", i))
    return prompts, params, keys


def _tokens_and_logprobs(output) -> tuple[list[int], list[float]]:
    out = output.outputs[0]
    tokens = list(out.token_ids)
    return _until_eos(tokens), [step[t].logprob for t, step in zip(tokens, out.logprobs, strict=True)]


def _compare(got: dict, want: dict, logprobs_got: Optional[dict] = None, logprobs_want: Optional[dict] = None) -> dict:
    agree = sum(got[k] == want[k] for k in want)
    result = {"agree": agree, "of": len(want), "differ": [str(k) for k in want if got[k] != want[k]]}
    if logprobs_got is not None:
        # Equal tokens stop at the same end-of-text, so their logprob lists have the same length.
        same = [k for k in want if got[k] == want[k]]
        diffs = [abs(a - b) for k in same for a, b in zip(logprobs_got[k], logprobs_want[k], strict=True)]
        result["max_abs_logprob_diff"] = max(diffs) if diffs else None
    return result


def _preemptions(llm) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


def _run_family(family: str, out: str, stress: bool) -> dict:
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    model_path = _save_model(family, os.path.join(out, family))
    folders = _adapters(model_path, os.path.join(out, family + "-adapters"))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    rows, library = _references(model_path, folders, ids)
    common = dict(model=model_path, dtype="float32", max_model_len=256, seed=0, block_size=BLOCK)
    share = os.path.join(out, family + "-share")
    os.makedirs(share, exist_ok=True)
    result = {"text_tokens": [len(r) for r in ids]}

    start = time.perf_counter()
    llm = LLM(
        **common,
        enable_prompt_embeds=True,
        disable_log_stats=False,
        kv_transfer_config=KVTransferConfig(**_connector(share)),
    )
    result["engine_start_s"] = round(time.perf_counter() - start, 1)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=1)
    oracle, oracle_lp = {}, {}
    for n in folders:
        outputs = llm.generate([{"prompt_embeds": r} for r in rows[n]], greedy, use_tqdm=False)
        for i, o in enumerate(outputs):
            oracle[(n, i)], oracle_lp[(n, i)] = _tokens_and_logprobs(o)
    prompts, params, keys = _kv_requests(folders, ids, share)
    runs = {}
    for name in ("batch", "repeat"):  # the repeat finds the first run's full blocks in the prefix cache
        outputs = llm.generate(prompts, params, use_tqdm=False)
        got = {k: _tokens_and_logprobs(o) for k, o in zip(keys, outputs, strict=True)}
        runs[name] = (got, {k: o.num_cached_tokens for k, o in zip(keys, outputs, strict=True)})
    adapted = [k for k in keys if k[0] != "base"]
    for name, (got, cached) in runs.items():
        tokens = {k: got[k][0] for k in adapted}
        result[name] = {
            "vs_prompt_embeds": _compare(tokens, oracle, {k: got[k][1] for k in adapted}, oracle_lp),
            "vs_library_kv": _compare(tokens, {(n, i): library[n][i] for n, i in adapted}),
            "cached_tokens": sum(cached[k] for k in adapted),
        }
    base = {k: runs["batch"][0][k][0] for k in keys if k[0] == "base"}
    # An adapter that never changed the tokens would make the agreement above say nothing.
    result["adapter_changes_tokens"] = sum(oracle[(n, i)] != base[("base", i)] for n, i in oracle)
    result["requests_per_batch"] = len(prompts)
    del llm
    torch.cuda.empty_cache() if torch.cuda.is_available() else None

    if stress:
        # 32-token prefill chunks and 8 usable blocks (256 slots) for 16 requests of up to 92 tokens: chunked
        # prefill, and preemption by recomputation, which re-admits a request and has the connector load it again.
        llm = LLM(
            **common,
            max_num_batched_tokens=32,
            enable_chunked_prefill=True,
            num_gpu_blocks_override=9,  # one is vLLM's null block
            disable_log_stats=False,
            kv_transfer_config=KVTransferConfig(**_connector(share)),
        )
        outputs = llm.generate(prompts, params, use_tqdm=False)
        got = {k: _tokens_and_logprobs(o)[0] for k, o in zip(keys, outputs, strict=True)}
        result["chunked_preempted"] = {
            "vs_prompt_embeds": _compare({k: got[k] for k in adapted}, oracle),
            "base_vs_batch": _compare({k: got[k] for k in base}, base),
            "preemptions": _preemptions(llm),
        }
        del llm
    return result


def check(out_dir: str, families: tuple[str, ...] = ("gpt2", "llama"), stress: bool = True) -> dict:
    """Runs every family; returns (and writes to `out_dir`/result.json) the agreement counts and timings."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    result = {family: _run_family(family, out_dir, stress) for family in families}
    result["wall_s"] = round(time.perf_counter() - start, 1)
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "out", "vllm_kv"))
    parser.add_argument("--families", nargs="+", default=["gpt2", "llama"], help="also: smollm2 (the real model)")
    parser.add_argument("--no-stress", action="store_true")
    args = parser.parse_args()
    print(json.dumps(check(args.out, tuple(args.families), not args.no_stress), indent=2))

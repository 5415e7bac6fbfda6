"""vLLM's greedy tokens against this library's own `generate`, three ways: offline (`LLM.generate` with
`prompt_embeds`), through vLLM's OpenAI server with embeddings built by hand, and through `softprompt-plus serve` by
adapter name (the `openai` client, Completions and Chat, and both adapters at once)."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time

from _vllm_server import KEY, b64, post

NEW_TOKENS = 16
PLAIN = [
    "The capital of France is",
    "Once upon a time, there was",
    "The best way to learn Python is",
    "Water boils at",
]
CHATS = [
    "What is the tallest mountain in the world?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "Name a primary color.",
]


def build_adapters(path: str, out: str) -> dict[str, str]:
    """Two adapters on the real checkpoint: 20 vocabulary rows, and 10 rows of an instruction's own tokens."""
    from peft_softprompt_plus import SoftPromptPlusConfig

    configs = {
        "vocab20": SoftPromptPlusConfig(num_virtual_tokens=20, prompt_init="vocab", init_seed=0),
        "french10": SoftPromptPlusConfig(
            num_virtual_tokens=10,
            prompt_init="text",
            prompt_init_text="Always answer in French, in one short sentence.",
            tokenizer_name_or_path=path,
        ),
    }
    return save_adapters(path, configs, out)


def save_adapters(path: str, configs: dict, out: str) -> dict[str, str]:
    """Each config attached (seed 0) to the float32 checkpoint and saved as `out/<name>`."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    folders = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), config)
        folders[name] = os.path.join(out, name)
        model.save_pretrained(folders[name])
    return folders


def texts(tokenizer) -> list[str]:
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
        for c in CHATS
    ]
    return PLAIN + chats


def library_generate(path: str, folders: dict[str, str], rows: list[str]):
    """This library's greedy tokens, rows left-padded as one batch; and each row's `[N+L, D]` embeddings."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peft_softprompt_plus import prompt_embeds

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    # Plain rows as a completions server tokenizes them; chat rows already hold the template's special tokens.
    ids = [tokenizer(t, add_special_tokens=i < len(PLAIN))["input_ids"] for i, t in enumerate(rows)]
    batch = tokenizer.pad({"input_ids": ids}, return_tensors="pt")
    names = list(folders)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), folders[names[0]], names[0])
    for name in names[1:]:
        model.load_adapter(folders[name], adapter_name=name)
    model.eval()
    tokens, embeds = {}, {}
    base = model.get_base_model()
    with torch.no_grad():
        with model.disable_adapter():
            out = base.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
        tokens["base"] = _new(out, batch, tokenizer)
        for name in names:
            model.set_adapter(name)
            out = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
            tokens[name] = _new(out, batch, tokenizer)
            embeds[name] = prompt_embeds(model, batch["input_ids"], batch["attention_mask"], adapter_name=name)
    return ids, tokens, embeds, tokenizer


def _new(out, batch, tokenizer) -> list[list[int]]:
    rows = out[:, batch["input_ids"].shape[1] :].tolist()
    return [_until_eos(r, tokenizer.eos_token_id) for r in rows]


def _until_eos(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row


# ---------------------------------------------------------------------------------------------- vLLM


def vllm_offline(path: str, embeds: dict, eos: int) -> dict[str, list[list[int]]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, enable_prompt_embeds=True, dtype="float32", max_model_len=2048, seed=0)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    got = {}
    for name, rows in embeds.items():
        outputs = llm.generate([{"prompt_embeds": r.cpu()} for r in rows], params, use_tqdm=False)
        got[name] = [_until_eos(list(o.outputs[0].token_ids), eos) for o in outputs]
    del llm
    return got


def check(path: str, folders: dict, upstream: str, front_url: str, mine: tuple) -> dict:
    """Agreement counts through the server and the front (`mine`: `library_generate`'s answer), and the front's
    costs."""
    rows, ours, embeds, tokenizer = mine
    changed = sum(ours[n][i] != ours["base"][i] for n in folders for i in range(len(rows)))
    report = {"rows": len(rows), "changed_vs_base": changed}
    wanted = {n: [tokenizer.decode(t, skip_special_tokens=True) for t in ours[n]] for n in folders}
    direct, direct_bytes, direct_times = {}, [], []
    for name in folders:
        direct[name] = []
        for row in embeds[name]:
            body = {"model": path, "prompt_embeds": b64(row), "max_tokens": NEW_TOKENS, "temperature": 0}
            start = time.perf_counter()
            status, answer = post(f"{upstream}/v1/completions", body)
            direct_times.append(time.perf_counter() - start)
            direct_bytes.append(len(json.dumps(body)))
            direct[name].append(answer["choices"][0]["text"] if status == 200 else f"<{status}>")
    report["server"] = {n: sum(a == b for a, b in zip(direct[n], wanted[n], strict=True)) for n in folders}
    import openai

    client = openai.OpenAI(api_key=KEY, base_url=f"{front_url}/v1", max_retries=0)
    by_name, front_bytes, front_times = {}, [], []
    for name in folders:
        by_name[name] = []
        for i, text in enumerate(rows):
            start = time.perf_counter()
            if i < len(PLAIN):
                answer = client.completions.create(model=name, prompt=text, max_tokens=NEW_TOKENS, temperature=0)
                by_name[name].append(answer.choices[0].text)
                front_bytes.append(len(json.dumps({"model": name, "prompt": text})))
            else:
                messages = [{"role": "user", "content": CHATS[i - len(PLAIN)]}]
                answer = client.chat.completions.create(
                    model=name, messages=messages, max_tokens=NEW_TOKENS, temperature=0
                )
                by_name[name].append(answer.choices[0].message.content)
                front_bytes.append(len(json.dumps({"model": name, "messages": messages})))
            front_times.append(time.perf_counter() - start)
    report["front"] = {n: sum(a == b for a, b in zip(by_name[n], wanted[n], strict=True)) for n in folders}
    results: dict = {}

    def ask(name, i):
        answer = client.completions.create(model=name, prompt=PLAIN[i], max_tokens=NEW_TOKENS, temperature=0)
        results[(name, i)] = answer.choices[0].text

    threads = [threading.Thread(target=ask, args=(n, i)) for i in range(len(PLAIN)) for n in folders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report["interleaved"] = f"{sum(results[k] == wanted[k[0]][k[1]] for k in results)}/{len(threads)}"
    report.update(
        direct_ms=round(1000 * statistics.median(direct_times), 1),
        front_ms=round(1000 * statistics.median(front_times), 1),
        direct_request_bytes=int(statistics.median(direct_bytes)),
        front_request_bytes=int(statistics.median(front_bytes)),
    )
    return report


def offline(path: str, folders: dict, mine: tuple) -> dict:
    """`LLM.generate` with `prompt_embeds` against `generate`, rows equal per adapter."""
    _, ours, embeds, tokenizer = mine
    got = vllm_offline(path, embeds, tokenizer.eos_token_id)
    return {n: sum(a == b for a, b in zip(got[n], ours[n], strict=True)) for n in folders}


def mine(path: str, folders: dict) -> tuple:
    """(rows, this library's greedy tokens, its embeddings rows, the tokenizer)."""
    from transformers import AutoTokenizer

    rows = texts(AutoTokenizer.from_pretrained(path))
    _, ours, embeds, tokenizer = library_generate(path, folders, rows)
    return rows, ours, embeds, tokenizer

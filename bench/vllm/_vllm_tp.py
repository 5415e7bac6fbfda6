"""Part `tp` of bench/vllm_check.py: KV adapters across ranks. A tiny Llama (4 heads, 2 KV heads, 2 layers, head size
32) saved locally, served by vLLM for CPU at TP=1, TP=2 and PP=2 (one engine each, the same flags), with
`softprompt-plus serve` in front. Adapters: an input adapter (`prompt_embeds`), two native KV adapters (one from a
text start, one moved off its text start by noise), a KV adapter started from demonstrations whose text starts past
N (the front folds it at load), the same with its positions chosen per layer and KV head, and
`--compose both=kv-text,kv-noise`. Each reply through the front (Completions, Chat, streams of both, a mixed burst, an
immediate repeat) is compared with this library's `generate`.

Every engine runs chunked prefill (32 tokens a step) in 8 usable blocks of 32 slots, so the burst preempts requests
and the connector writes a re-admitted request again; an immediate repeat finds the first's full blocks in vLLM's
prefix cache (each KV adapter spans at least one full block, alone or in the composition)."""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request

from _vllm_server import KEY, front, prefix_cache, vllm_server

NEW_TOKENS = 16
PLAIN = [
    "the quick brown fox jumps over",
    "red green blue yellow",
    "a soft prompt is a learned sequence of",
    "cat dog bird fish horse",
]
CHATS = ["name a colour", "which animal is fast"]
CHAT_TEMPLATE = (  # the tiny tokenizer has none; the front and `generate` both read this one
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
DEMOS = ["red green blue cat dog", "one two three four five", "the lazy dog sleeps", "hello world this is"]
COMPOSE = ("both", ("kv-text", "kv-noise"))
# One engine per layout, the same flags: chunked prefill of 32 tokens and 8 usable blocks of 32 (one is the null
# block) for a burst of 24 requests of up to ~110 positions, so requests are preempted and re-admitted.
ENGINE = [
    *("--max-model-len", "256", "--block-size", "32", "--enable-prefix-caching"),
    *("--max-num-batched-tokens", "32", "--num-gpu-blocks-override", "9", "--seed", "0"),
]
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "serve_at_tp2.md")


def _page_layout(page: str = PAGE) -> tuple[list[str], str]:
    """The TP=2 engine as examples/serve_at_tp2.md starts it: its parallel flag and thread binding, so this part runs
    the page's engine."""
    text = open(page, encoding="utf-8").read()
    size = re.search(r"--tensor-parallel-size (\d+)", text)
    bind = re.search(r'VLLM_CPU_OMP_THREADS_BIND="([^"]+)"', text)
    if size is None or bind is None:
        raise SystemExit(f"{page} no longer starts vLLM with --tensor-parallel-size and VLLM_CPU_OMP_THREADS_BIND")
    return ["--tensor-parallel-size", size.group(1)], bind.group(1)


LAYOUTS = {  # name -> (vLLM flags, VLLM_CPU_OMP_THREADS_BIND: one core per worker)
    "tp1": (["--tensor-parallel-size", "1"], "0-1"),
    "tp2": _page_layout(),
    "pp2": (["--pipeline-parallel-size", "2"], "0|1"),
}


def build(out: str) -> tuple[str, dict[str, str]]:
    """The tiny Llama and the adapters' folders by served name."""
    import torch
    from _vllm_kv_check import tiny_llama
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from peft_softprompt_plus import SoftPromptPlusConfig

    path = tiny_llama(out, CHAT_TEMPLATE)
    kv = dict(task_type="CAUSAL_LM", prompt_level="kv", tokenizer_name_or_path=path)
    configs = {
        "input": SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=10, prompt_init="vocab", init_seed=3),
        "kv-text": SoftPromptPlusConfig(num_virtual_tokens=8, prompt_init="text", prompt_init_text=DEMOS[0], **kv),
        # 40 positions: a full block of 32 and more, alone
        "kv-noise": SoftPromptPlusConfig(num_virtual_tokens=40, prompt_init="text", prompt_init_text=PLAIN[2], **kv),
        # 12 positions selected of the demonstrations' ~24: the text starts past N, at the context's length
        "kv-demos": SoftPromptPlusConfig(
            num_virtual_tokens=12, prompt_init="demonstrations", prompt_init_texts=DEMOS, **kv
        ),
        # the same, its 12 positions chosen per layer and KV head: each rank writes its own heads' entries
        "kv-perhead": SoftPromptPlusConfig(
            num_virtual_tokens=12, prompt_init="demonstrations", prompt_init_texts=DEMOS, kv_selection="per_head", **kv
        ),
    }
    folders = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), config)
        if name == "kv-noise":  # moved off its text start, as training moves it
            with torch.no_grad():
                for p in (p for p in model.parameters() if p.requires_grad):
                    p.add_(0.5 * p.std() * torch.randn_like(p))
        folders[name] = os.path.join(out, "tp-adapters", name)
        model.save_pretrained(folders[name])
    return path, folders


def rows(tokenizer) -> list[tuple[str, object, list[int]]]:
    """(route, what the client sends, the ids the front reads) for each prompt."""
    out = [("completions", text, tokenizer(text)["input_ids"]) for text in PLAIN]
    for text in CHATS:
        messages = [{"role": "user", "content": text}]
        chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(("chat", messages, tokenizer(chat, add_special_tokens=False)["input_ids"]))
    return out


def load_all(path: str, folders: dict[str, str]):
    """The base at `path` with every adapter of `folders` loaded under its served name, in eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    names = list(folders)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), folders[names[0]], names[0])
    for name in names[1:]:
        model.load_adapter(folders[name], adapter_name=name)
    return model.eval()


def references(path: str, folders: dict[str, str]) -> tuple[dict[str, list[str]], dict]:
    """Our `generate`'s greedy text per served name (and the base's), one row at a time; and facts on the adapters."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    names = list(folders)
    model = load_all(path, folders)
    active = {**{n: n for n in names}, COMPOSE[0]: list(COMPOSE[1])}
    wanted = {}

    def text(out, ids) -> str:
        new = out[0, len(ids) :].tolist()
        new = new[: new.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in new else new
        return tokenizer.decode(new, skip_special_tokens=True)

    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    ids = [i for _, _, i in rows(tokenizer)]
    with torch.no_grad():
        with model.disable_adapter():
            base = model.get_base_model()
            wanted["base"] = [text(base.generate(input_ids=torch.tensor([i]), **greedy), i) for i in ids]
        for served, adapter in active.items():
            model.set_adapter(adapter)
            wanted[served] = [text(model.generate(input_ids=torch.tensor([i]), **greedy), i) for i in ids]
    facts = {
        "text_start": {n: model.peft_config[n].kv_text_start for n in names if n.startswith("kv-")},
        "rows_changed_from_base": {n: sum(map(str.__ne__, w, wanted["base"])) for n, w in wanted.items()},
    }
    return wanted, facts


def _ask(url: str, model: str, route: str, sent, stream: bool = False) -> str:
    """One greedy request through the front; the reply's text (a stream's chunks joined), or `!status: message`."""
    import openai

    client = openai.OpenAI(api_key=KEY, base_url=f"{url}/v1", max_retries=0, timeout=600)
    options = dict(model=model, max_tokens=NEW_TOKENS, temperature=0, stream=stream)
    try:
        if route == "chat":
            answer = client.chat.completions.create(messages=sent, **options)
            if stream:
                return "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
            return answer.choices[0].message.content
        answer = client.completions.create(prompt=sent, **options)
        if stream:
            return "".join(c.choices[0].text for c in answer if c.choices)
        return answer.choices[0].text
    except openai.APIStatusError as err:
        return f"!{err.status_code}: {str(err)[:200]}"


def _tally(got: list, want: list) -> dict:
    wrong = [{"got": g, "want": w} for g, w in zip(got, want, strict=True) if g != w]
    return {"equal": len(got) - len(wrong), "of": len(got), "first_wrong": wrong[:2]}


def serve_check(url: str, upstream: str, wanted: dict[str, list[str]], tokenizer) -> dict:
    """Every served name through the front: each row then its immediate repeat, a Completions and a Chat stream, and
    a burst of every name's Completions at once."""
    prompts = rows(tokenizer)
    names = list(wanted)
    counts = {}
    before = _engine_counters(upstream)
    for name in names:
        first, repeat = [], []
        for route, sent, _ in prompts:
            first.append(_ask(url, name, route, sent))
            repeat.append(_ask(url, name, route, sent))  # its full blocks are in vLLM's prefix cache now
        plain = len(PLAIN)
        streams = [_ask(url, name, "completions", PLAIN[0], True), _ask(url, name, "chat", prompts[plain][1], True)]
        counts[name] = {
            "completions": _tally(first[:plain], wanted[name][:plain]),
            "chat": _tally(first[plain:], wanted[name][plain:]),
            "repeat": _tally(repeat, wanted[name]),
            "streams": _tally(streams, [wanted[name][0], wanted[name][plain]]),
        }
    after_rows = _engine_counters(upstream)
    jobs = [(n, i) for n in names for i in range(len(PLAIN))]
    got = [None] * len(jobs)
    gate = threading.Barrier(len(jobs))

    def one(k: int) -> None:
        gate.wait()
        got[k] = _ask(url, jobs[k][0], "completions", PLAIN[jobs[k][1]])

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(jobs))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    burst_s = time.perf_counter() - start
    after = _engine_counters(upstream)
    burst = _tally(got, [wanted[n][i] for n, i in jobs])
    preempted = after["preemptions"] - after_rows["preemptions"]
    kv_names = [n for n in names if n.startswith("kv-") or n == COMPOSE[0]]
    return {
        "by_name": counts,
        "burst": {**burst, "seconds": round(burst_s, 1), "preemptions": preempted},
        "prefix_cache_hit_tokens": after_rows["hits"] - before["hits"],
        "preemptions_in_rows": after_rows["preemptions"] - before["preemptions"],
        "total": _sum([c for n in names for c in counts[n].values()] + [burst]),
        "kv_total": _sum([c for n in kv_names for c in counts[n].values()]),
        "health": _status(f"{url}/health"),
        "front_errors_metric": _front_errors(url),
    }


def _sum(tallies: list[dict]) -> str:
    return f"{sum(t['equal'] for t in tallies)}/{sum(t['of'] for t in tallies)}"


def _engine_counters(upstream: str) -> dict:
    queries, hits = prefix_cache(upstream)
    with urllib.request.urlopen(f"{upstream}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    preempted = sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:num_preemptions_total")
    )
    return {"queries": queries, "hits": hits, "preemptions": preempted}


def _status(url: str) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return -1


def _front_errors(url: str) -> str:
    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            text = answer.read().decode()
    except OSError as err:
        return f"unreadable: {err}"
    lines = [line for line in text.splitlines() if "error" in line and not line.startswith("#")]
    return "; ".join(lines[:6]) or "none"


def check(out: str, layouts: tuple[str, ...] = tuple(LAYOUTS)) -> dict:
    """Builds the model and adapters, then serves them at each layout in turn; the report by layout."""
    from transformers import AutoTokenizer

    from peft_softprompt_plus.serve.kv_fields import vllm_config

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    path, folders = build(out)
    wanted, facts = references(path, folders)
    wanted[os.path.basename(path)] = wanted.pop("base")  # the front serves the base by its folder's name
    tokenizer = AutoTokenizer.from_pretrained(path)
    report = {"adapters": facts}
    compose = f"{COMPOSE[0]}={','.join(COMPOSE[1])}"
    for k, layout in enumerate(layouts):
        flags, bind = LAYOUTS[layout]
        share = os.path.join(out, f"kv-share-{layout}")
        os.makedirs(share, mode=0o750, exist_ok=True)
        connector = ["--kv-transfer-config", vllm_config(share)]
        env = {"VLLM_CPU_OMP_THREADS_BIND": bind}
        start = time.perf_counter()
        try:
            with (
                vllm_server(path, 8031 + k, out, *ENGINE, *flags, *connector, env=env, seconds=420) as upstream,
                front(path, 8131 + k, upstream, folders, out, "--kv-share", share, "--compose", compose) as url,
            ):
                started = round(time.perf_counter() - start, 1)
                engine = _engine_layout(os.path.join(out, f"vllm_server_{8031 + k}.log"))
                report[layout] = {"engine": engine, "engine_start_s": started}
                report[layout].update(serve_check(url, upstream, wanted, tokenizer))
        except (RuntimeError, TimeoutError) as err:  # the engine refused the layout: its log says why
            report[layout] = {"failed": str(err), "log_tail": _tail(os.path.join(out, f"vllm_server_{8031 + k}.log"))}
        report[layout]["wall_s"] = round(time.perf_counter() - start, 1)
    return report


def _engine_layout(log: str) -> dict:
    """The parallel sizes vLLM's engine reports at start, read from its log."""
    with open(log) as handle:
        text = handle.read()
    return {f"{k}_parallel_size": int(v) for k, v in re.findall(r"\b(tensor|pipeline)_parallel_size=(\d+)", text)}


def _tail(log: str, lines: int = 12) -> list[str]:
    try:
        with open(log) as handle:
            return [line.rstrip()[:300] for line in handle.readlines()[-lines:]]
    except OSError:
        return []

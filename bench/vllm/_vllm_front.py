"""`softprompt-plus serve` against the real vLLM: fuzzed request bodies (tests/serve/serve_bodies.py), the load of 64
concurrent requests over input and KV adapters against the same requests sent straight to vLLM (with the front's own
CPU seconds), and vLLM's prefix cache for an adapter with a long kept-text prefix. The front and vLLM share this
machine's CPU cores."""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
import urllib.request

from _vllm_server import KEY, b64, post, prefix_cache, ttft

from peft_softprompt_plus._names import SAVED_KEY, SAVED_KV_KEY, VLLM_KV_PARAM, VLLM_KV_SERVED

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "serve"))
QUESTIONS = [
    "The capital of Italy is",
    "My favourite food is",
    "The sun rises in the",
    "A good name for a cat is",
    "The ocean is",
    "Bread is made from",
    "In winter it is",
    "The fastest animal is",
]
# A system prompt kept as hard text (as a distilled prompt keeps its facts): ~520 tokens in front of 20 soft rows.
KEPT = (
    "You are the assistant of the Harbour Museum of Lisbon. The museum opens at nine and closes at six, every day "
    "but Monday. Tickets cost twelve euros; children under twelve enter free. The permanent collection holds ships' "
    "instruments, maps from the fifteenth century and a full-size caravel deck. "
) * 9


def build(path: str, out: str) -> dict[str, str]:
    """Two more adapters for the load (4 in all with the agreement's two) and the long-prefix one."""
    from _vllm_agreement import save_adapters
    from transformers import AutoTokenizer

    from peft_softprompt_plus import SoftPromptPlusConfig

    kept = AutoTokenizer.from_pretrained(path)(KEPT)["input_ids"][:520]
    configs = {
        "vocab16": SoftPromptPlusConfig(num_virtual_tokens=16, prompt_init="vocab", init_seed=1),
        "brief8": SoftPromptPlusConfig(
            num_virtual_tokens=8, prompt_init="text", prompt_init_text="Answer briefly.", tokenizer_name_or_path=path
        ),
        "kept540": SoftPromptPlusConfig(
            num_virtual_tokens=20, prompt_init="vocab", init_seed=2, prompt_prefix_ids=kept
        ),
    }
    return save_adapters(path, configs, out)


def fuzz(front_url: str, models: list[str], vocab: int, examples: int = 60) -> dict:
    """Valid bodies must get a 200, malformed ones a JSON 400 that names the field, and the front keeps serving."""
    import serve_bodies
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    tally = {"valid_200": 0, "valid_other": [], "malformed_400_named": 0, "malformed_other": [], "still_serving": 0}

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def one(data):
        if data.draw(st.booleans()):
            route, body, name = data.draw(serve_bodies.malformed(models, vocab))
            status, answer = post(_route(front_url, route), body, KEY)
            message = (answer.get("error") or {}).get("message", "")
            if status == 400 and f"`{name}" in message:
                tally["malformed_400_named"] += 1
            else:
                tally["malformed_other"].append((status, name, message[:120]))
        else:
            route = data.draw(st.sampled_from(["completions", "chat"]))
            strategy = serve_bodies.completion(models, vocab) if route == "completions" else serve_bodies.chat(models)
            body = data.draw(strategy)
            status, answer = post(_route(front_url, route), body, KEY)
            if status == 200:
                tally["valid_200"] += 1
            else:
                tally["valid_other"].append((status, str(answer)[:160]))
        status, _ = post(_route(front_url, "completions"), {"model": models[0], "prompt": "a", "max_tokens": 1}, KEY)
        tally["still_serving"] += status == 200

    one()
    tally["examples"] = tally["valid_200"] + len(tally["valid_other"]) + tally["malformed_400_named"]
    tally["examples"] += len(tally["malformed_other"])
    return tally


def _route(url: str, route: str) -> str:
    return f"{url}/v1/" + ("chat/completions" if route == "chat" else "completions")


def load(path: str, folders: dict[str, str], upstream: str, front_url: str, rounds: int = 4) -> dict:
    """64 concurrent requests over the adapters, through the front and straight to vLLM with what the front sends:
    an input adapter's embeddings, a KV adapter's placeholder ids with the connector's fields (its file is the one
    the front published), each with its `cache_salt`; and the front's own CPU seconds per request."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peft_softprompt_plus import prompt_embeds

    tokenizer = AutoTokenizer.from_pretrained(path)
    names = list(folders)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), folders[names[0]], names[0])
    for name in names[1:]:
        model.load_adapter(folders[name], adapter_name=name)
    fields = {name: _upstream_fields(model, name, folders[name]) for name in names}
    placeholder = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    jobs = [(names[i % len(names)], QUESTIONS[(i // len(names)) % len(QUESTIONS)]) for i in range(64)]
    options = {"max_tokens": 16, "temperature": 0}
    direct = []
    with torch.no_grad():
        for name, text in jobs:
            ids = tokenizer(text)["input_ids"]
            body = {"model": path, "cache_salt": fields[name]["salt"], **options}
            if fields[name]["kv"]:  # as serve_kv.fields builds it
                n = fields[name]["positions"]
                body.update(prompt=[placeholder] * n + ids, kv_transfer_params={VLLM_KV_PARAM: fields[name]["salt"]})
            else:
                body["prompt_embeds"] = b64(prompt_embeds(model.eval(), torch.tensor([ids]), adapter_name=name)[0])
            direct.append(body)
    via_front = [{"model": name, "prompt": text, **options} for name, text in jobs]
    times = {"direct": [], "front": []}
    by_kind = {(arm, kv): [] for arm in times for kv in (False, True)}
    errors = {"direct": 0, "front": 0}
    arms = [("direct", direct, upstream, None), ("front", via_front, front_url, KEY)]
    for _, bodies, url, key in arms:  # warm-up, not counted: the engine meets every batch size once
        _burst(f"{url}/v1/completions", bodies, key)
    ratios, cpu, answers = [], 0.0, {}
    for round_ in range(rounds):
        took = {}
        for kind, bodies, url, key in arms if round_ % 2 == 0 else arms[::-1]:  # each goes first in turn
            before = _front_cpu(front_url)
            took[kind], failed, answers[kind] = _burst(f"{url}/v1/completions", bodies, key)
            cpu += _front_cpu(front_url) - before if kind == "front" else 0.0
            times[kind] += took[kind]
            errors[kind] += failed
            for k, (name, _) in enumerate(jobs):
                by_kind[kind, fields[name]["kv"]].append(took[kind][k])
        ratios.append(round(statistics.median(took["front"]) / statistics.median(took["direct"]) - 1, 4))
    p50 = {k: statistics.median(v) for k, v in times.items()}
    kv_rows = [k for k, (name, _) in enumerate(jobs) if fields[name]["kv"]]
    marks = [(answers["direct"][k].get("kv_transfer_params") or {}).get(VLLM_KV_SERVED) for k in kv_rows]
    served = sum(mark == fields[jobs[k][0]]["salt"] for mark, k in zip(marks, kv_rows, strict=True))
    texts = {kind: [(a.get("choices") or [{}])[0].get("text") for a in got] for kind, got in answers.items()}
    return {
        "requests_per_burst": len(jobs),
        "adapters": {name: "kv" if fields[name]["kv"] else "input" for name in names},
        "errors": errors,
        "direct_p50_ms": round(1000 * p50["direct"], 1),
        "front_p50_ms": round(1000 * p50["front"], 1),
        "front_added_p50": round(p50["front"] / p50["direct"] - 1, 4),
        "front_added_p50_by_round": ratios,
        "p50_ms_by_kind": {
            f"{arm}_{'kv' if kv else 'input'}": round(1000 * statistics.median(t), 1)
            for (arm, kv), t in by_kind.items()
        },
        "front_cpu_s_per_request": round(cpu / (rounds * len(jobs)), 4),
        "direct_kv_served_by_connector": f"{served}/{len(kv_rows)}",
        "front_text_equals_direct_last_round": f"{sum(map(str.__eq__, texts['front'], texts['direct']))}/{len(jobs)}",
    }


def _upstream_fields(model, name: str, folder: str) -> dict:
    """What the front sends upstream for adapter `name`: its `cache_salt` (for a KV adapter also its share file's
    name, its content hash as serve_share.publish computes it) and, for KV, its N positions."""
    from peft_softprompt_plus.files.content_hash import content_hash
    from peft_softprompt_plus.files.inspect_adapter import read_adapter

    config, prompt = read_adapter(folder)
    if config.get("prompt_level") != "kv":
        return {"kv": False, "salt": content_hash(config, {SAVED_KEY: prompt})}
    values = model.base_model.prompt_bank.values(name).detach().float().cpu().contiguous()
    digest = content_hash(config, {SAVED_KV_KEY: values})
    return {"kv": True, "salt": digest, "positions": int(config["num_virtual_tokens"])}


def _front_cpu(front_url: str) -> float:
    """The front's own CPU seconds (user + system), from its Prometheus process collector."""
    request = urllib.request.Request(f"{front_url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        text = answer.read().decode()
    return sum(float(line.split()[1]) for line in text.splitlines() if line.startswith("process_cpu_seconds_total "))


def _burst(url: str, bodies: list[dict], key) -> tuple[list[float], int, list[dict]]:
    """Every body posted at once: the seconds each took and the answers, in `bodies`' order; how many failed."""
    took, failed, answers = [0.0] * len(bodies), [], [{}] * len(bodies)
    gate = threading.Barrier(len(bodies))

    def one(k: int, body: dict) -> None:
        gate.wait()
        start = time.perf_counter()
        status, answers[k] = post(url, body, key)
        took[k] = time.perf_counter() - start
        failed.append(status != 200)

    threads = [threading.Thread(target=one, args=(k, b)) for k, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return took, sum(failed), answers


def prefix(front_url: str, upstream: str) -> dict:
    """Time to the first token of the long-prefix adapter: first, repeated, and the same prefix with another
    question; and vLLM's own prefix-cache hit rate over the two later requests."""
    url = f"{front_url}/v1/completions"
    first = ttft(url, {"model": "kept540", "prompt": "Question: when does it open?", "max_tokens": 4}, KEY)
    queries, hits = prefix_cache(upstream)
    repeat = ttft(url, {"model": "kept540", "prompt": "Question: when does it open?", "max_tokens": 4}, KEY)
    other = ttft(url, {"model": "kept540", "prompt": "Question: what does a ticket cost?", "max_tokens": 4}, KEY)
    queries_after, hits_after = prefix_cache(upstream)
    asked = queries_after - queries
    return {
        "ttft_first_ms": round(1000 * first, 1),
        "ttft_repeat_ms": round(1000 * repeat, 1),
        "ttft_other_question_ms": round(1000 * other, 1),
        "hit_rate_after_first": round((hits_after - hits) / asked, 3) if asked else None,
    }


def lift(path: str, folders: dict[str, str], out: str) -> dict[str, str]:
    """The agreement's input adapters lifted exactly to KV prompts (`prompt_init="adapter"`, the same N)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from peft_softprompt_plus import SoftPromptPlusConfig
    from peft_softprompt_plus.files.inspect_adapter import read_adapter

    lifted = {}
    for name, folder in folders.items():
        n = read_adapter(folder)[0]["num_virtual_tokens"]
        config = SoftPromptPlusConfig(
            num_virtual_tokens=n, prompt_level="kv", prompt_init="adapter", prompt_init_adapter=folder
        )
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), config)
        lifted[f"kv-{name}"] = os.path.join(out, f"kv-{name}")
        model.save_pretrained(lifted[f"kv-{name}"])
    return lifted


def kv(front_url: str, lifted: dict[str, str], mine: tuple) -> dict:
    """The KV adapters by name through the front and vLLM's connector, against the input adapters' replies (this
    library's `generate`, which vLLM's `prompt_embeds` path equals): Completions, Chat, streamed, and repeated."""
    import openai
    from _vllm_agreement import CHATS, NEW_TOKENS, PLAIN

    rows, ours, _, tokenizer = mine
    client = openai.OpenAI(api_key=KEY, base_url=f"{front_url}/v1", max_retries=0)
    report = {}
    for kv_name in lifted:
        name = kv_name[len("kv-") :]
        wanted = [tokenizer.decode(t, skip_special_tokens=True) for t in ours[name]]
        got = []
        for _ in range(2):  # the second pass finds the placeholders' full blocks in vLLM's prefix cache
            for i in range(len(rows)):
                if i < len(PLAIN):
                    answer = client.completions.create(
                        model=kv_name, prompt=PLAIN[i], max_tokens=NEW_TOKENS, temperature=0
                    )
                    got.append(answer.choices[0].text)
                else:
                    messages = [{"role": "user", "content": CHATS[i - len(PLAIN)]}]
                    answer = client.chat.completions.create(
                        model=kv_name, messages=messages, max_tokens=NEW_TOKENS, temperature=0
                    )
                    got.append(answer.choices[0].message.content)
        stream = client.completions.create(
            model=kv_name, prompt=PLAIN[0], max_tokens=NEW_TOKENS, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].text for c in stream)
        report[kv_name] = {
            "equal": sum(a == b for a, b in zip(got, wanted * 2, strict=True)),
            "of": len(got),
            "streamed_equal": streamed == wanted[0],
        }
    return report

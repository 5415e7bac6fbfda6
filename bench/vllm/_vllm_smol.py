"""Parts `smol` and `limit` of bench/vllm_check.py, on the real SmolLM2-135M-Instruct at TP=1.

`smol`: KV adapters behind `softprompt-plus serve` and vLLM's KV connector, each reply (Completions, Chat, a stream
of each) against this library's `generate`: two native KV adapters (a text start, trained a few steps off it), a
`selected` distillation student and one that keeps its facts as the teacher's own keys/values (`keep_text`), a
context-tuned adapter whose positions were chosen per layer and KV head (`kv_selection="per_head"`, a few steps
trained; these three start their text past N: the front folds them at load) and `--compose kv-ab=kv-a,kv-b`.
`limit`: a front with small `--max-in-flight` and `--max-tokens-in-flight`, fired well past them."""

from __future__ import annotations

import json
import os
import threading
import urllib.request

from _vllm_server import KEY, front
from _vllm_tp import _ask, _sum, _tally

NEW_TOKENS = 16
PLAIN = ["The capital of France is", "Once upon a time, there was", "Water boils at"]
CHATS = ["Give me a synonym for happy.", "How many legs does a spider have?"]
KV_TEXTS = {  # each KV adapter's text start, its first N tokens' keys/values
    "kv-a": "Always answer like a pirate, in one short sentence.",
    "kv-b": "You love numbers and give exact facts.",
}
COMPOSE = ("kv-ab", ("kv-a", "kv-b"))
PER_HEAD = "kv-perhead"  # context tuning's per-head start, trained: its text starts past N, folded at load
DEMOS = ["Paris -> France\n", "Rome -> Italy\n", "Lisbon -> Portugal\n", "Vienna -> Austria\n", "Oslo -> Norway\n"]
STUDENT = "student"
KEPT = "The shop opens at 8 am every day but Tuesday. A city bike costs 15 euros a day; an electric bike costs 30."
STUDENTS = {STUDENT: None, "student-kept": KEPT}  # served name -> its kept passage
SYSTEM = (  # the student's system prompt: short, so that a few distillation steps run in seconds
    "You are Nora, the assistant of the Portmere bike shop on Pier 9. The shop opens at 8 am every day but Tuesday. "
    "A city bike costs 15 euros a day; an electric bike costs 30."
)
TURNS = [
    "When do you open?",
    "How much is a bike for a day?",
    "Where is the shop?",
    "Are you open on Tuesday?",
    "What is your name?",
    "Can I rent an electric bike?",
]
HELD_OUT = ["Is the shop near the sea?", "What does an e-bike cost?"]
PROBE = ("What time does the shop open?", ("8",))  # one probe: each costs three greedy replies of 64 tokens


def build(path: str, out: str, student: bool = True) -> tuple[dict[str, str], dict]:
    """The native KV adapters (and the student) saved under `out`, by served name; and facts on how they were made."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peft_softprompt_plus import SoftPromptPlusConfig

    tokenizer = AutoTokenizer.from_pretrained(path)
    folders, facts = {}, {}
    for name, text in KV_TEXTS.items():
        torch.manual_seed(0)
        config = SoftPromptPlusConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=8, prompt_level="kv", prompt_init="text",
            prompt_init_text=text, tokenizer_name_or_path=path,
        )  # fmt: skip
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), config)
        trained = [p for p in model.parameters() if p.requires_grad]
        start = [p.detach().clone() for p in trained]
        optimizer = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.0)
        batch = tokenizer([f"{t} {text}" for t in TURNS], return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        for _ in range(5):  # a few steps of next-token loss: the keys/values leave their text start
            loss = model(**batch, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        moved = max(float((p.detach() - s).abs().max() / s.abs().max()) for p, s in zip(trained, start, strict=True))
        facts[name] = {"steps": 5, "last_loss": round(loss.item(), 3), "max_change_over_max_start": round(moved, 4)}
        folders[name] = os.path.join(out, "smol-adapters", name)
        model.save_pretrained(folders[name])
    folders[PER_HEAD], facts[PER_HEAD] = _per_head(path, tokenizer, os.path.join(out, "smol-adapters", PER_HEAD))
    for name, kept in STUDENTS.items() if student else ():
        folders[name], facts[name] = _student(path, tokenizer, os.path.join(out, "smol-adapters", name), kept)
    return folders, facts


def _per_head(path: str, tokenizer, folder: str) -> tuple[str, dict]:
    """Context tuning's per-head start (`kv_selection="per_head"`, 12 of the demonstrations' positions per layer and
    KV head, its text at the context's length), trained a few steps with leave-one-out on the demonstrations."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from peft_softprompt_plus import SoftPromptPlusConfig

    torch.manual_seed(0)
    config = SoftPromptPlusConfig(
        task_type="CAUSAL_LM", prompt_level="kv", prompt_init="demonstrations", prompt_init_texts=DEMOS,
        num_virtual_tokens=12, kv_selection="per_head", tokenizer_name_or_path=path,
    )  # fmt: skip
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), config).train()
    optimizer = torch.optim.AdamW([model.base_model.prompt()], lr=1e-2, weight_decay=0.0)
    for step in range(4):  # each a demonstration, read without its own entries
        ids = torch.tensor([tokenizer(DEMOS[step % len(DEMOS)], add_special_tokens=False)["input_ids"]])
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(folder)
    config = model.peft_config["default"]
    facts = {"num_virtual_tokens": config.num_virtual_tokens, "kv_text_start": config.kv_text_start, "steps": 4}
    facts["leave_one_out"] = dict(model.base_model.forward_state.leave_one_out)
    return folder, facts


def _student(path: str, tokenizer, folder: str, kept=None) -> tuple[str, dict]:
    """A KV student of SYSTEM from its `selected` start (N=8 of the system turn's positions; with `kept`, the
    passage's and the template's positions as the teacher's keys/values and 8 selected), a few steps trained."""
    from transformers import AutoModelForCausalLM

    from peft_softprompt_plus import DistillOptions, distill_prompt
    from peft_softprompt_plus.distill.content import Probe
    from peft_softprompt_plus.distill.data import kept_positions, prepare
    from peft_softprompt_plus.distill.score import gap_closed

    n = 8
    if kept is not None:
        facts, frame = kept_positions(tokenizer, prepare(tokenizer, SYSTEM, True, 1), kept)
        n += len(set(facts) | set(frame) | {0})
    options = DistillOptions(
        num_virtual_tokens=n, prompt_level="kv", prompt_init="selected", self_study=False, steps=6, batch_size=4,
        samples_per_turn=2, held_out_samples_per_turn=1, max_new_tokens=12, evaluate_at=(0, 6), keep_text=kept,
    )  # fmt: skip
    model = distill_prompt(
        AutoModelForCausalLM.from_pretrained(path), tokenizer, SYSTEM, options, user_turns=TURNS,
        held_out_turns=HELD_OUT, probes=[Probe(*PROBE)], progress=lambda line: print(f"student: {line}", flush=True),
    )  # fmt: skip
    model.save_pretrained(folder)
    report = model.distill_report
    config = model.peft_config["default"]
    facts = {
        "num_virtual_tokens": config.num_virtual_tokens,
        "kv_text_start": config.kv_text_start,
        "kept_positions": report.kept_positions,
        "facts": report.facts,
        "steps": options.steps,
        "gap_closed_by_step": {str(c.step): round(gap_closed(c.held_out, report.none), 4) for c in report.curve},
        "gap_closed": round(report.gap_closed, 4),
    }
    return folder, facts


def rows(tokenizer, student: bool) -> list[tuple[str, object, list[int]]]:
    """(route, what the client sends, the ids the front reads): a student's chat is its text after the system turn."""
    from peft_softprompt_plus.distill.data import student_text

    out = [("completions", text, tokenizer(text)["input_ids"]) for text in PLAIN]
    for text in CHATS:
        messages = [{"role": "user", "content": text}]
        chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        chat = student_text(tokenizer, messages) if student else chat
        out.append(("chat", messages, tokenizer(chat, add_special_tokens=False)["input_ids"]))
    return out


def references(path: str, folders: dict[str, str]) -> dict[str, list[str]]:
    """Our `generate`'s greedy text per served name, one row at a time (the composition: `set_adapter` of a list)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    names = list(folders)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folders[names[0]], names[0])
    for name in names[1:]:
        model.load_adapter(folders[name], adapter_name=name)
    model.eval()
    wanted = {}
    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    with torch.no_grad():
        for served, adapter in {**{n: n for n in names}, COMPOSE[0]: list(COMPOSE[1])}.items():
            model.set_adapter(adapter)
            wanted[served] = []
            for _, _, ids in rows(tokenizer, served in STUDENTS):
                new = model.generate(input_ids=torch.tensor([ids]), **greedy)[0, len(ids) :].tolist()
                new = new[: new.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in new else new
                wanted[served].append(tokenizer.decode(new, skip_special_tokens=True))
    return wanted


def check(url: str, wanted: dict[str, list[str]], tokenizer) -> dict:
    """Every served name through the front: each row, then a Completions and a Chat stream."""
    counts = {}
    for name, want in wanted.items():
        prompts = rows(tokenizer, name in STUDENTS)
        got = [_ask(url, name, route, sent) for route, sent, _ in prompts]
        plain = len(PLAIN)
        streams = [_ask(url, name, "completions", PLAIN[0], True), _ask(url, name, "chat", prompts[plain][1], True)]
        counts[name] = {
            "completions": _tally(got[:plain], want[:plain]),
            "chat": _tally(got[plain:], want[plain:]),
            "streams": _tally(streams, [want[0], want[plain]]),
        }
    total = _sum([c for by_route in counts.values() for c in by_route.values()])
    return {"by_name": counts, "total": total}


def limit(path: str, folders: dict[str, str], upstream: str, out: str, *flags: str, fire: int = 96) -> dict:
    """A second front on the same engine, with 4 requests and 96 tokens in flight at most, fired `fire` requests at
    once (half asking 8 tokens, half 32): each answer's status and Retry-After, those never answered, and a normal
    request after."""
    names = [*folders, os.path.basename(path)]
    small = ["--max-in-flight", "4", "--max-tokens-in-flight", "96"]
    with front(path, 8112, upstream, folders, out, *small, *flags) as url:
        got = [None] * fire
        gate = threading.Barrier(fire)

        def one(k: int) -> None:
            body = {"model": names[k % len(names)], "prompt": PLAIN[k % len(PLAIN)], "max_tokens": (8, 32)[k % 2]}
            gate.wait()
            got[k] = _post_headers(f"{url}/v1/completions", body)

        threads = [threading.Thread(target=one, args=(k,)) for k in range(fire)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        answered = [g for g in got if g is not None and g[0] != -1]  # -1: the connection failed, no answer
        refused = [g for g in answered if g[0] == 429]
        after = _post_headers(f"{url}/v1/completions", {"model": names[0], "prompt": PLAIN[0], "max_tokens": 8})
        return {
            "fired": fire,
            "answered": len(answered),
            "lost": fire - len(answered),
            "status_200": sum(g[0] == 200 for g in answered),
            "status_429": len(refused),
            "status_other": sorted({(g[0], g[2][:120]) for g in answered if g[0] not in (200, 429)}),
            "429_with_retry_after": sum(g[1] is not None for g in refused),
            "429_requests_limit": sum("--max-in-flight" in g[2] for g in refused),
            "429_tokens_limit": sum("--max-tokens-in-flight" in g[2] for g in refused),
            "after_status": after[0],
            "in_flight_after": _gauge(url, "softprompt_plus_requests_in_flight"),
        }


def _post_headers(url: str, body: dict) -> tuple[int, object, str]:
    """(status, its Retry-After header or None, the error message or ''); a failed connection is status -1."""

    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as answer:
            answer.read()
            return answer.status, answer.headers.get("Retry-After"), ""
    except urllib.error.HTTPError as err:
        text = err.read().decode(errors="replace")
        try:
            message = (json.loads(text).get("error") or {}).get("message", "")
        except (ValueError, AttributeError):
            message = text[:200]
        return err.code, err.headers.get("Retry-After"), message
    except OSError as err:
        return -1, None, str(err)


def _gauge(url: str, name: str) -> float:
    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        text = answer.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))

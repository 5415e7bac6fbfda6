"""Part `trust` of bench/vllm_check.py: a 200 from `softprompt-plus serve` is the adapter's answer, whatever refused a
request before it, and no request sent to vLLM directly stops the engine. On the real SmolLM2 at TP=1 (blocks of
128) and the tiny Llama at TP=2 (blocks of 32), each engine with prefix caching and the connector:

- for each way a share file breaks (missing, torn, planted: the right config with another tensor, unreadable: a
  folder in its place), a fresh KV adapter with N at least a block (its placeholders fill block 0) and one with N
  below a block (the prompts longer than a block): loaded, its file broken, a request (a 502), the same request at
  once (the front wrote the file again where it could), the file put right as an operator would (the adapter PUT
  again), then that prompt and another, each reply against this library's `generate`;
- a client that sends vLLM the placeholder ids with the adapter's share-file name (or a guess) as `cache_salt`: its
  reply is the base reading the placeholders, with no prefix-cache hit, and the adapter's next reply is still exact;
- malformed `kv_transfer_params` sent to vLLM directly (wrong types, a path, no salt), after which the engine still
  answers and every adapter replies exactly through the front."""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.request

from _vllm_direct import direct_client, malformed
from _vllm_server import KEY, front, vllm_server
from _vllm_tp import NEW_TOKENS  # what its `_ask` asks for

KINDS = ("missing", "torn", "planted", "unreadable")
INIT_TEXT = (  # a KV adapter's start: the keys/values of its first N tokens (N up to 140 on SmolLM2)
    "The harbour of Saltmere is small and old. Ferries leave the north pier at seven, nine and eleven in the "
    "morning, and at two, four and six in the afternoon. A single ticket costs four euros and a return costs seven; "
    "children under twelve travel free. Bicycles ride for one euro. In winter the six o'clock boat does not run, and "
    "in a storm every crossing waits until the harbour master raises the white flag again. The cafe by the pier opens "
    "at half past six and sells warm bread, fish soup and strong coffee to the crews before they sail out."
) * 2
STORIES = (  # the requests' texts, cut per engine to a little over one block (`_prompts`)
    "The old lighthouse stands on the rocks at the end of the long sea wall, and its lamp turns every night from "
    "dusk until dawn, guiding the fishing boats home through the narrow channel between the sandbanks, where the "
    "current runs fast when the tide turns. Visitors climb its hundred steps in summer to look out over the bay, the "
    "islands and the dunes, and on a clear day they can count the sails of the racing yachts far out beyond the "
    "buoys, while the gulls circle the keeper's cottage and the bell on the reef rings with every wave. Tell me what "
    "I should see first in this town, and why, and whether the walk along the dunes to the old fort is worth the "
    "time on a windy afternoon in early spring, when the ferries run less often and the cafes close early.",
    "Please plan my day. I arrive by train at ten in the morning with a bicycle and one small bag. I want to cross "
    "to the island, walk along the beach for a few hours, eat something warm near the water, look at the seals on "
    "the sandbank if the tide is low, buy a postcard for my mother, and be back on the mainland before dark, because "
    "the last train home leaves at eight in the evening and I must not miss it, since my sister waits at the other "
    "end with the car. Which boat do I take, and what does it cost with the bicycle? I also wonder whether the "
    "cafe by the pier is open early enough for breakfast, and whether they keep a table by the window for people "
    "who come alone with a book and want to watch the ferries load the cars and the cattle for the island farms.",
)
ENGINES = {  # name -> (model, vLLM flags, VLLM_CPU_OMP_THREADS_BIND, block size, N for "big" and "small")
    "smol_tp1": ("smollm2", ["--enable-prefix-caching"], "0-1", 128, {"big": 140, "small": 8}),
    "llama_tp2": (
        "llama",
        [
            "--max-model-len",
            "256",
            "--block-size",
            "32",
            "--enable-prefix-caching",
            "--seed",
            "0",
            "--tensor-parallel-size",
            "2",
        ],
        "0|1",
        32,
        {"big": 40, "small": 8},
    ),  # fmt: skip
}


def _model(family: str, out: str) -> str:
    if family == "smollm2":
        from peft_softprompt_plus import fetch_checkpoint

        return fetch_checkpoint("smollm2")
    from _vllm_kv_check import tiny_llama
    from _vllm_tp import CHAT_TEMPLATE

    return tiny_llama(out, CHAT_TEMPLATE)


def _prompts(tokenizer, block: int) -> tuple[str, ...]:
    """Each story cut to its first words past `block` + 16 tokens: longer than a block, so a KV prompt below a block
    shares its first block with the text."""
    out = []
    for story in STORIES:
        words = story.split()
        k = next(
            (k for k in range(1, len(words) + 1) if len(tokenizer(" ".join(words[:k]))["input_ids"]) > block + 16)
        )
        out.append(" ".join(words[:k]))
    return tuple(out)


def build(path: str, out: str, sizes: dict[str, int]) -> dict[str, str]:
    """One KV adapter per (size, kind), each its own content (a text start moved by seeded noise), by served name."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from peft_softprompt_plus import SoftPromptPlusConfig

    folders = {}
    for seed, (size, kind) in enumerate((s, k) for s in sizes for k in KINDS):
        config = SoftPromptPlusConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=sizes[size], prompt_level="kv", prompt_init="text",
            prompt_init_text=INIT_TEXT, tokenizer_name_or_path=path,
        )  # fmt: skip
        torch.manual_seed(seed)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), config)
        with torch.no_grad():  # moved off its text start, as training moves it: each adapter its own content
            for p in (p for p in model.parameters() if p.requires_grad):
                p.add_(0.1 * p.std() * torch.randn_like(p))
        folders[f"{size}-{kind}"] = os.path.join(out, "trust-adapters", f"{size}-{kind}")
        model.save_pretrained(folders[f"{size}-{kind}"])
    return folders


def references(path: str, folders: dict[str, str], placeholder: int, prompts: tuple[str, ...]) -> dict:
    """Our `generate`'s greedy text for each adapter and prompt; and the base reading a big adapter's placeholders
    then prompts[0] (what a client without the adapter's blocks gets)."""
    import torch
    from _vllm_tp import load_all
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    names = list(folders)
    model = load_all(path, folders)
    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False)

    def text(out, ids) -> str:
        new = out[0, len(ids) :].tolist()
        new = new[: new.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in new else new
        return tokenizer.decode(new, skip_special_tokens=True)

    wanted = {}
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    with torch.no_grad():
        for name in names:
            model.set_adapter(name)
            wanted[name] = [text(model.generate(input_ids=torch.tensor([i]), **greedy), i) for i in ids]
        n = model.peft_config[names[0]].num_virtual_tokens
        with model.disable_adapter():
            row = [placeholder] * n + ids[0]
            base = model.get_base_model().generate(input_ids=torch.tensor([row]), **greedy)
            wanted["placeholders_as_text"] = text(base, row)
    return wanted


def _ask(url: str, name: str, prompt: str, stream: bool = False) -> str:
    from _vllm_tp import _ask as ask

    return ask(url, name, "completions", prompt, stream)


def _put(url: str, name: str, folder: str) -> int:
    request = urllib.request.Request(
        f"{url}/v1/adapters/{name}",
        data=json.dumps({"path": folder}).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        method="PUT",
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            return answer.status
    except urllib.error.HTTPError as err:
        return err.code


def _break(path: str, kind: str) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    if kind == "missing":
        os.remove(path)
    elif kind == "torn":  # an interrupted copy
        with open(path, "rb") as handle:
            head = handle.read(200)
        with open(path, "wb") as handle:
            handle.write(head)
    elif kind == "planted":  # the right config, another tensor
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata()
        save_file({k: torch.zeros_like(v) for k, v in load_file(path).items()}, path, metadata=metadata)
    elif kind == "unreadable":  # no file to read under that name
        os.remove(path)
        os.mkdir(path)


def _newest(share: str) -> str:
    """The share file the front published last (each adapter here has its own content, so a PUT writes a file)."""
    return max((os.path.join(share, f) for f in os.listdir(share)), key=os.path.getmtime)


def refusals(url: str, share: str, folders: dict[str, str], wanted: dict, prompts: tuple[str, ...]) -> dict:
    """Each adapter: loaded, its file broken, refused, retried at once, put right (PUT again), then both prompts."""
    out = {}
    for name, folder in folders.items():
        kind = name.split("-", 1)[1]
        row = {"put": _put(url, name, folder)}
        path = _newest(share)
        row["digest"] = os.path.splitext(os.path.basename(path))[0]
        _break(path, kind)
        first = _ask(url, name, prompts[0])
        row["refused"] = first[:200] if first.startswith("!") else "200"
        retry = _ask(url, name, prompts[0])
        row["retry_at_once"] = "equal" if retry == wanted[name][0] else retry[:200]
        if os.path.isdir(path):
            shutil.rmtree(path)
        row["put_again"] = _put(url, name, folder)
        got = [_ask(url, name, p) for p in prompts]
        row["after_fix"] = {"equal": sum(map(str.__eq__, got, wanted[name])), "of": len(prompts)}
        replies = [first, retry, *got]
        expected = [wanted[name][0], wanted[name][0], *wanted[name]]
        row["wrong_200"] = sum(g != w and not g.startswith("!") for g, w in zip(replies, expected, strict=True))
        out[name] = row
    return out


def check(out: str, engines: tuple[str, ...] = tuple(ENGINES)) -> dict:
    from transformers import AutoTokenizer

    from peft_softprompt_plus.serve.kv_fields import vllm_config

    report = {}
    for k, name in enumerate(engines):
        family, flags, bind, block, sizes = ENGINES[name]
        folder = os.path.join(out, f"trust-{name}")
        os.makedirs(folder, exist_ok=True)
        path = _model(family, folder)
        tokenizer = AutoTokenizer.from_pretrained(path)
        placeholder = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
        prompts = _prompts(tokenizer, block)
        folders = build(path, folder, sizes)
        wanted = references(path, folders, placeholder, prompts)
        share = os.path.join(folder, "kv-share")
        os.makedirs(share, mode=0o750, exist_ok=True)
        env = {"VLLM_CPU_OMP_THREADS_BIND": bind}
        start = time.perf_counter()
        ids = [tokenizer(p)["input_ids"] for p in prompts]
        row = {"block_size": block, "sizes": sizes, "prompt_tokens": [len(i) for i in ids]}
        with (
            vllm_server(path, 8051 + k, folder, *flags, "--kv-transfer-config", vllm_config(share), env=env) as up,
            front(path, 8151 + k, up, {}, folder, "--kv-share", share) as url,
        ):
            row["engine_start_s"] = round(time.perf_counter() - start, 1)
            row["refusals"] = refusals(url, share, folders, wanted, prompts)
            big = next(n for n in folders if n.startswith("big"))
            placeholders = [placeholder] * sizes["big"]
            row["direct_client"] = direct_client(
                up, path, big, row["refusals"][big]["digest"], placeholders + ids[0], wanted
            )
            row["direct_client"]["adapter_after"] = _ask(url, big, prompts[0]) == wanted[big][0]
            row["malformed"] = malformed(url, up, path, folders, wanted, placeholders + ids[1], prompts[1], _ask)
            row["front_metrics"] = _refusal_metrics(url)
        rows = row["refusals"].values()
        row["summary"] = {
            "refused_first": f"{sum(r['refused'] != '200' for r in rows)}/{len(rows)}",
            "wrong_200": sum(r["wrong_200"] for r in rows),
            "after_fix": f"{sum(r['after_fix']['equal'] for r in rows)}/{sum(r['after_fix']['of'] for r in rows)}",
            "retry_at_once_equal": f"{sum(r['retry_at_once'] == 'equal' for r in rows)}/{len(rows)}",
        }
        row["wall_s"] = round(time.perf_counter() - start, 1)
        report[name] = row
    return report


def _refusal_metrics(url: str) -> list[str]:
    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        text = answer.read().decode()
    wanted = ("softprompt_plus_refusals_total", "softprompt_plus_kv_salts_moved_total")
    return [line for line in text.splitlines() if line.startswith(wanted)]

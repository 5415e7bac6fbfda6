"""The Hub round trip against a loopback fake Hub (`_hub_server.py`): push, download and load, the model card, and
the failure modes.

`huggingface_hub` reads `HF_ENDPOINT` and `HF_HUB_OFFLINE` when it is imported, so the client side runs in one child
process (this file run as a script, `_client_side`) pointed at the fake Hub; it records what happened as JSON and the
tests below assert on that record and on the files the fake Hub received.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import runpy
import socket
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]  # tests/, where the helpers live
sys.path.insert(0, str(HERE))
from _hub_server import FakeHub  # noqa: E402

BASE_REPO = "tiny-org/tiny-gpt2"
ADAPTER_REPO = "user/softprompt"
NATIVE_REPO = "user/softprompt-native"
LOCAL_BASE_REPO = "user/softprompt-local-base"
EMPTY_REPO = "user/not-an-adapter"
NO_WEIGHTS_REPO = "user/config-only"
EXAMPLE_REPO = "user/example"
KV_REPO = "user/softprompt-kv"
SAVED_KEY = "base_model.softprompt_plus.prompt"
ADAPTER_FILES = ["README.md", "adapter_config.json", "adapter_model.safetensors"]


def _child_env(endpoint: str, work: Path) -> dict:
    env = dict(os.environ)
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HUB_OFFLINE="0",
        TRANSFORMERS_OFFLINE="0",
        HF_TOKEN="hf_fake_token_for_the_loopback_hub",
        HF_HOME=str(work / "hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1",
        TMPDIR=str(work / "tmp"),
    )
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    return env


def _dead_endpoint() -> str:
    with socket.socket() as sock:  # a port that was just free: nothing listens there
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _tree_digest(path: Path) -> dict:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in path.rglob("*") if p.is_file()
    }


@pytest.fixture(scope="module")
def hub_run(tmp_path_factory):
    """Run the client side once against a fresh fake Hub; yields (record, hub, workdir)."""
    work = tmp_path_factory.mktemp("hub")
    with FakeHub() as hub:
        record_path = work / "record.json"
        args = [sys.executable, __file__, str(work), str(record_path), _dead_endpoint()]
        out = subprocess.run(args, env=_child_env(hub.url, work), capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        yield json.loads(record_path.read_text()), hub, work


def _card(hub, repo: str) -> str:
    return hub.files(repo)["README.md"].decode()


# ---------------------------------------------------------------------------------------------- push and load


def test_push_uploads_exactly_the_adapter_files(hub_run):
    record, hub, _ = hub_run
    assert record["push"]["error"] is None
    files = hub.files(ADAPTER_REPO, revision=record["push"]["oid"])  # the commit this push made, not a later one
    assert sorted(files) == ADAPTER_FILES
    from safetensors.torch import load

    tensors = load(files["adapter_model.safetensors"])
    assert set(tensors) == {SAVED_KEY}
    assert tensors[SAVED_KEY].dtype.is_floating_point and str(tensors[SAVED_KEY].dtype) == "torch.float32"
    assert tensors[SAVED_KEY].tolist() == record["prompt"]
    config = json.loads(files["adapter_config.json"])
    assert config["peft_type"] == "SOFTPROMPT_PLUS" and config["num_virtual_tokens"] == 4
    assert config["base_model_name_or_path"] == BASE_REPO
    assert hub.unhandled == []  # every request the client made is one the fake Hub implements


def test_from_pretrained_downloads_and_loads_bit_equal(hub_run):
    record, _, _ = hub_run
    assert record["load"]["error"] is None
    assert record["load"]["prompt_equal"] is True
    assert record["load"]["logits_max_abs_diff"] == 0.0
    assert record["load"]["trainable"] == []  # loaded for inference, like any PEFT adapter
    assert record["auto_load"]["logits_max_abs_diff"] == 0.0  # AutoPeftModel found the base through the config


def test_model_card_says_what_and_how(hub_run):
    _, hub, _ = hub_run
    card = _card(hub, ADAPTER_REPO)
    from huggingface_hub import ModelCard

    meta = ModelCard(card).data
    assert meta.library_name == "peft"
    assert meta.base_model == BASE_REPO
    assert {"peft", "softprompt-plus", "prompt-tuning", "soft-prompt"} <= set(meta.tags)
    assert "num_virtual_tokens (N): 4" in card
    assert "prompt shape: [4, 64] float32" in card
    assert "init: `vocab`" in card  # the default
    assert "eval_loss: 1.25" in card  # the training metrics the model carried
    snippet = card[card.index("```python") :].splitlines()
    assert snippet[1].startswith("import peft_softprompt_plus")
    assert f'PeftModel.from_pretrained(base, "{ADAPTER_REPO}")' in card
    assert f'from_pretrained("{BASE_REPO}")' in card
    assert card.count("## Soft prompt (peft-softprompt-plus)") == 1


def test_model_card_snippet_runs_as_written(hub_run):
    record, _, _ = hub_run
    assert record["snippet"]["error"] is None
    assert record["snippet"]["logits_max_abs_diff"] == 0.0


def test_repush_keeps_the_text_the_owner_wrote_on_the_hub(hub_run):
    record, hub, _ = hub_run
    assert record["repush"]["error"] is None
    from huggingface_hub import ModelCard

    def outside_our_section(text: str) -> str:
        return re.sub(
            r"<!-- softprompt-plus:start -->.*<!-- softprompt-plus:end -->\n*", "", text, flags=re.S
        ).rstrip()

    after = ModelCard(_card(hub, ADAPTER_REPO)).text
    assert "Written by the owner on the Hub." in after
    assert outside_our_section(after) == outside_our_section(record["repush"]["owner_card"])
    assert after.count("## Soft prompt (peft-softprompt-plus)") == 1


def test_local_base_path_is_kept_out_of_hub_metadata(hub_run):
    """The Hub refuses a commit whose card says `base_model: /some/path` (the fake Hub enforces that rule too)."""
    record, hub, work = hub_run
    assert record["local_base"]["error"] is None
    from huggingface_hub import ModelCard

    card = _card(hub, LOCAL_BASE_REPO)
    meta = ModelCard(card).data
    assert meta.get("base_model") is None
    assert not any(str(t).startswith("base_model:") for t in meta.tags)
    assert str(work / "tiny-gpt2") in card and "a local path" in card


def test_local_resave_replaces_only_our_section(make_peft, tmp_path):
    """model_card.py: the user's own headings (even a top-level `#`) survive any number of re-saves."""
    model = make_peft()
    model.softprompt_plus_metrics = {"eval_loss": 2.5}
    model.save_pretrained(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text() + "\n# My adapter\n\nWhat it is for.\n\n## Results\n\nGood ones.\n")
    before = readme.read_text()
    model.softprompt_plus_metrics = {"eval_loss": 1.5}
    model.save_pretrained(tmp_path)
    after = readme.read_text()
    assert after.count("## Soft prompt (peft-softprompt-plus)") == 1
    assert "eval_loss: 1.5" in after and "eval_loss: 2.5" not in after
    assert after.replace("eval_loss: 1.5", "eval_loss: 2.5").rstrip() == before.rstrip()


def test_peft_model_push_to_hub_writes_our_card(hub_run):
    record, hub, _ = hub_run
    assert record["native_push"]["error"] is None
    assert sorted(hub.files(NATIVE_REPO)) == ADAPTER_FILES
    card = _card(hub, NATIVE_REPO)
    assert "library_name: peft" in card
    assert f'PeftModel.from_pretrained(base, "{NATIVE_REPO}")' in card


# ---------------------------------------------------------------------------------------------- bad input


def test_unreachable_endpoint_is_clear_and_changes_nothing_locally(hub_run):
    record, hub, work = hub_run
    error = record["unreachable"]["error"]
    assert error["type"] == "ConnectionError"
    assert (
        "Could not reach the Hub at `HF_ENDPOINT`=" in error["message"] and "Nothing was uploaded" in error["message"]
    )
    assert record["unreachable"]["local_dir_unchanged"] is True
    assert os.listdir(work / "tmp") == []  # no staging folder left behind
    assert "user/never-pushed" not in hub.repos


def test_repo_without_adapter_files(hub_run):
    record, _, _ = hub_run
    error = record["empty_repo"]["error"]
    assert error["type"] == "ValueError" and f"Can't find 'adapter_config.json' at '{EMPTY_REPO}'" in error["message"]
    error = record["no_weights_repo"]["error"]
    assert error["type"] == "ValueError" and "adapter_model.safetensors" in error["message"]
    error = record["missing_repo"]["error"]
    assert error["type"] == "ValueError" and "user/does-not-exist" in error["message"]
    error = record["inspect_empty_repo"]["error"]
    assert error["type"] == "ValueError" and "has no adapter_config.json" in error["message"]
    assert record["incomplete_downloads"] == []


def test_wrong_base_is_explained(hub_run):
    record, _, _ = hub_run
    error = record["wrong_base"]["error"]
    assert error["type"] == "AdapterFileError"  # a ValueError
    assert "hidden size 64, but this base model's is 32" in error["message"]


def test_inspect_reads_a_hub_repo(hub_run):
    record, _, _ = hub_run
    report = record["inspect"]
    assert report["shape"] == [4, 64] and report["config"]["peft_type"] == "SOFTPROMPT_PLUS"
    assert len(report["tokens"]) == 4 and all(len(t["nearest"]) == 3 for t in report["tokens"])


def test_a_kv_adapter_pushes_and_loads_bit_equal(hub_run):
    record, hub, _ = hub_run
    assert record["kv"]["error"] is None and record["kv"]["logits_equal"] is True
    from safetensors.torch import load

    from peft_softprompt_plus._names import SAVED_KV_KEY

    assert set(load(hub.files(KV_REPO)["adapter_model.safetensors"])) == {SAVED_KV_KEY}
    assert "A KV prompt for a frozen" in _card(hub, KV_REPO)
    assert record["kv"]["inspect"]["shape"] == [2, 2, 4, 3, 16] and len(record["kv"]["inspect"]["layers"]) == 2


def test_push_refuses_a_model_that_is_not_ours(make_base):
    from peft_softprompt_plus.files.hub import push_to_hub

    with pytest.raises(
        ValueError, match=r"`model` must be a PeftModel with a SOFTPROMPT_PLUS adapter, got GPT2LMHead"
    ) as caught:
        push_to_hub(make_base(), "user/x")
    # The same error `prompt_embeds` raises: a TypeError, and a ValueError as it was before 0.3.
    import torch

    from peft_softprompt_plus import prompt_embeds

    assert isinstance(caught.value, TypeError)
    with pytest.raises(type(caught.value), match=str(caught.value).split(",")[0]):
        prompt_embeds(make_base(), torch.ones(1, 2, dtype=torch.long))


def test_push_in_offline_mode_is_clear(make_peft, tmp_path):
    import huggingface_hub

    if not huggingface_hub.constants.HF_HUB_OFFLINE:
        pytest.skip("this process was started with HF_HUB_OFFLINE=0")
    from peft_softprompt_plus.files.hub import push_to_hub

    model = make_peft()
    model.save_pretrained(tmp_path / "adapter")
    before = _tree_digest(tmp_path)
    with pytest.raises(ConnectionError, match=r"Could not reach the Hub.*unset HF_HUB_OFFLINE"):
        push_to_hub(model, "user/x")
    assert _tree_digest(tmp_path) == before


# ---------------------------------------------------------------------------------------------- the example


def test_example_pushes_and_reloads(hub_run):
    """examples/push_to_hub.py, run in the client process with `--endpoint` at the fake Hub."""
    record, hub, _ = hub_run
    assert record["example"]["error"] is None
    assert record["example"]["exit_code"] == 0
    assert sorted(hub.files(EXAMPLE_REPO)) == ADAPTER_FILES
    assert "reloaded from the Hub: logits identical" in record["example"]["stdout"]
    assert "train_loss" in _card(hub, EXAMPLE_REPO)


def test_example_starts_its_own_fake_hub_by_default(monkeypatch):
    for var in ("HF_ENDPOINT", "HF_HUB_OFFLINE", "HF_TOKEN", "HF_HOME"):
        monkeypatch.setenv(var, "restored-after-the-test")  # so that monkeypatch puts each one back
    namespace = runpy.run_path(str(HERE.parent / "examples" / "push_to_hub.py"), run_name="example")
    with namespace["hub_endpoint"](None) as url:
        assert url.startswith("http://127.0.0.1:") and os.environ["HF_ENDPOINT"] == url
        assert os.environ["HF_HUB_OFFLINE"] == "0" and os.environ["HF_TOKEN"] != "restored-after-the-test"
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(f"{url}/api/models/user/nothing-here", timeout=10)
        assert answer.value.code == 404 and answer.value.headers["X-Error-Code"] == "RepoNotFound"


# ---------------------------------------------------------------------------------------------- client side


def _client_side(work: Path, dead_endpoint: str) -> dict:
    """Runs in the child process, with HF_ENDPOINT pointing at the fake Hub."""
    import torch
    from huggingface_hub import HfApi, ModelCard, hf_hub_download
    from peft import AutoPeftModelForCausalLM, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from peft_softprompt_plus import SoftPromptPlusConfig
    from peft_softprompt_plus.apps.tiny import save_tiny, tiny_gpt2
    from peft_softprompt_plus.files.hub import push_to_hub
    from peft_softprompt_plus.files.inspect_adapter import inspect_adapter

    record: dict = {}

    def attempt(name: str, fn) -> None:
        entry = record.setdefault(name, {})
        start = time.perf_counter()
        try:
            entry.update(fn() or {})
            entry["error"] = None
        except Exception as err:  # the record is the assertion surface; the trace helps when a test fails
            entry["error"] = {"type": type(err).__name__, "message": str(err)}
            print(f"--- {name}\n{traceback.format_exc()}", file=sys.stderr)
        entry["seconds"] = round(time.perf_counter() - start, 2)

    api = HfApi()
    local_base = save_tiny(str(work / "tiny-gpt2"))
    api.create_repo(BASE_REPO)
    api.upload_folder(repo_id=BASE_REPO, folder_path=local_base)
    ids = torch.tensor([[5, 9, 17, 33, 2, 8]])

    def fresh_base():
        return AutoModelForCausalLM.from_pretrained(BASE_REPO).eval()

    model = get_peft_model(
        fresh_base(), SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, init_seed=0)
    )
    with torch.no_grad():
        model.base_model.prompt("default").normal_(generator=torch.Generator().manual_seed(1))
    model.eval()
    model.softprompt_plus_metrics = {"eval_loss": 1.25}
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    record["prompt"] = model.base_model.prompt("default").tolist()

    def diff(other) -> float:
        with torch.no_grad():
            return (other(input_ids=ids).logits - expected).abs().max().item()

    attempt("push", lambda: {"oid": push_to_hub(model, ADAPTER_REPO).oid})

    def load():
        loaded = PeftModel.from_pretrained(fresh_base(), ADAPTER_REPO)
        prompt = loaded.base_model.prompt("default")
        return {
            "prompt_equal": torch.equal(prompt, model.base_model.prompt("default")),
            "logits_max_abs_diff": diff(loaded),
            "trainable": [n for n, p in loaded.named_parameters() if p.requires_grad],
        }

    attempt("load", load)
    attempt("auto_load", lambda: {"logits_max_abs_diff": diff(AutoPeftModelForCausalLM.from_pretrained(ADAPTER_REPO))})

    def snippet():
        card = Path(hf_hub_download(ADAPTER_REPO, "README.md")).read_text()
        code = card.split("```python\n", 1)[1].split("```", 1)[0]
        scope: dict = {}
        exec(code, scope)  # what a reader of the card would paste
        return {"logits_max_abs_diff": diff(scope["model"].eval())}

    attempt("snippet", snippet)

    def repush():
        card = ModelCard(Path(hf_hub_download(ADAPTER_REPO, "README.md")).read_text())
        card.text += "\n## Notes\n\nWritten by the owner on the Hub.\n"
        api.upload_file(path_or_fileobj=str(card).encode(), path_in_repo="README.md", repo_id=ADAPTER_REPO)
        push_to_hub(model, ADAPTER_REPO)
        return {"owner_card": card.text}

    attempt("repush", repush)

    def local_base_push():
        base = AutoModelForCausalLM.from_pretrained(local_base)
        push_to_hub(
            get_peft_model(base, SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)), LOCAL_BASE_REPO
        )

    attempt("local_base", local_base_push)
    attempt("native_push", lambda: {"url": str(model.push_to_hub(NATIVE_REPO))})

    def unreachable():
        saved = work / "saved-adapter"
        model.save_pretrained(saved)
        before = _tree_digest(saved)
        try:
            push_to_hub(model, "user/never-pushed", endpoint=dead_endpoint)
        finally:
            record["unreachable"]["local_dir_unchanged"] = _tree_digest(saved) == before

    attempt("unreachable", unreachable)

    api.create_repo(EMPTY_REPO)
    api.upload_file(path_or_fileobj=b"# not an adapter\n", path_in_repo="README.md", repo_id=EMPTY_REPO)
    api.create_repo(NO_WEIGHTS_REPO)
    config_only = hf_hub_download(ADAPTER_REPO, "adapter_config.json")
    api.upload_file(path_or_fileobj=config_only, path_in_repo="adapter_config.json", repo_id=NO_WEIGHTS_REPO)
    attempt("empty_repo", lambda: PeftModel.from_pretrained(fresh_base(), EMPTY_REPO) and None)
    attempt("no_weights_repo", lambda: PeftModel.from_pretrained(fresh_base(), NO_WEIGHTS_REPO) and None)
    attempt("missing_repo", lambda: PeftModel.from_pretrained(fresh_base(), "user/does-not-exist") and None)
    attempt("inspect_empty_repo", lambda: inspect_adapter(EMPTY_REPO) and None)
    attempt("wrong_base", lambda: PeftModel.from_pretrained(tiny_gpt2(n_embd=32), ADAPTER_REPO) and None)
    attempt("inspect", lambda: inspect_adapter(ADAPTER_REPO, base=local_base, top_k=3).to_dict())

    def example():
        namespace = runpy.run_path(str(HERE.parent / "examples" / "push_to_hub.py"), run_name="example")
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            code = namespace["main"](["--endpoint", os.environ["HF_ENDPOINT"], "--repo", EXAMPLE_REPO, "--steps", "3"])
        return {"exit_code": code, "stdout": stdout.getvalue()}

    attempt("example", example)

    def kv():
        kv_model = get_peft_model(fresh_base(), SoftPromptPlusConfig(num_virtual_tokens=3, prompt_level="kv"))
        push_to_hub(kv_model, KV_REPO)
        loaded = PeftModel.from_pretrained(fresh_base(), KV_REPO)
        with torch.no_grad():
            same = torch.equal(loaded(input_ids=ids).logits, kv_model.eval()(input_ids=ids).logits)
        return {"logits_equal": same, "inspect": inspect_adapter(KV_REPO).to_dict()}

    attempt("kv", kv)
    record["incomplete_downloads"] = [str(p) for p in (work / "hf-home").rglob("*.incomplete")]
    return record


if __name__ == "__main__":
    work_dir, record_file, dead = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    record_file.write_text(json.dumps(_client_side(work_dir, dead)))

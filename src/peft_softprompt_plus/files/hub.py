"""Push a soft-prompt adapter to the Hugging Face Hub with its model card intact.

`transformers`' `PushToHubMixin.push_to_hub` (which `PeftModel` inherits) replaces the README that `save_pretrained`
wrote with a generic transformers card, and the Hub refuses a local path as `base_model`. This module saves into a
temporary folder, writes our card for the Hub, and uploads that folder in one commit.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from typing import Optional

from huggingface_hub import HfApi, ModelCard
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

from .._names import METHOD
from ..method.errors import not_ours
from .model_card import write_model_card


def _transport_errors() -> tuple[type[BaseException], ...]:
    """What a dead endpoint raises: `OSError` (offline mode, refused sockets) and the HTTP client's transport
    errors, which share no base class with it (huggingface_hub 2.x talks through httpx2, 1.x through httpx)."""
    found: list[type[BaseException]] = [OSError]
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError")):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


_TRANSPORT_ERRORS = _transport_errors()


def _check_model(model) -> None:
    if getattr(model, "peft_type", None) != METHOD:
        raise not_ours(model)


def _unreachable(api: HfApi, repo_id: str, err: BaseException) -> ConnectionError:
    return ConnectionError(
        f"Could not reach the Hub at `HF_ENDPOINT`={api.endpoint!r} to push `repo_id`={repo_id!r}: "
        f"{type(err).__name__}: {err}. Nothing was uploaded and no local file was changed. Check the network and the "
        "endpoint URL (set HF_ENDPOINT before importing huggingface_hub, or pass `endpoint=`), and unset "
        "HF_HUB_OFFLINE if it is set."
    )


def _call(api: HfApi, repo_id: str, fn, /, *args, **kwargs):
    """Run one Hub call, turning connection failures (not the Hub's own HTTP answers) into one clear error."""
    try:
        return fn(*args, **kwargs)
    except HfHubHTTPError:
        raise  # the Hub answered: its message (auth, permissions, bad metadata) is the useful one
    except _TRANSPORT_ERRORS as err:
        raise _unreachable(api, repo_id, err) from err


def _seed_remote_readme(api: HfApi, repo_id: str, revision: Optional[str], folder: str) -> None:
    """Start from the card already on the Hub, so text the owner wrote there survives a re-push."""
    try:
        remote = api.hf_hub_download(repo_id, "README.md", revision=revision)
    except (EntryNotFoundError, HfHubHTTPError):
        return
    shutil.copyfile(remote, os.path.join(folder, "README.md"))


def push_to_hub(
    model,
    repo_id: str,
    *,
    commit_message: Optional[str] = None,
    commit_description: Optional[str] = None,
    private: Optional[bool] = None,
    token: Optional[str] = None,
    revision: Optional[str] = None,
    create_pr: bool = False,
    tags: Optional[list[str]] = None,
    endpoint: Optional[str] = None,
    max_shard_size=None,
):
    """Upload `model`'s adapter (config, float32 prompt, model card) to `repo_id`, creating the repo if needed.

    Keyword arguments follow `PeftModel.push_to_hub`; `max_shard_size` is accepted and ignored (a prompt is one
    small tensor). `endpoint` overrides `HF_ENDPOINT` for this call. Returns the `huggingface_hub.CommitInfo`.
    Raises `ConnectionError` when the endpoint can't be reached, before anything is saved or uploaded.
    """
    _check_model(model)
    api = HfApi(endpoint=endpoint, token=token)
    # Creating the repo first doubles as the reachability check: a dead endpoint fails before any work.
    repo_id = _call(api, repo_id, api.create_repo, repo_id, private=private, exist_ok=True).repo_id
    with tempfile.TemporaryDirectory(prefix="softprompt-plus-push-") as folder:
        _call(api, repo_id, _seed_remote_readme, api, repo_id, revision, folder)
        model.save_pretrained(folder)
        write_model_card(model, folder, adapter_ref=repo_id, for_hub=True)
        if tags:
            _add_tags(folder, tags)
        return _call(
            api,
            repo_id,
            api.upload_folder,
            repo_id=repo_id,
            folder_path=folder,
            commit_message=commit_message or "Upload soft prompt adapter (peft-softprompt-plus)",
            commit_description=commit_description,
            revision=revision,
            create_pr=create_pr,
        )


def _add_tags(folder: str, tags: list[str]) -> None:
    path = os.path.join(folder, "README.md")
    card = ModelCard.load(path)
    card.data["tags"] = sorted(set(card.data.get("tags") or []) | set(tags))
    card.save(path)

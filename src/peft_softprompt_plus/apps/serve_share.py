"""The KV share folder behind `softprompt-plus serve --kv-share`: each KV adapter's keys/values as
`<content hash>.safetensors`, checked against that hash before it is served (a file already there is hashed again,
never trusted), readable by the group, and removed once no served adapter names it and no request in flight reads it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections import Counter
from typing import Callable, Optional

import torch
from safetensors.torch import save_file

from .._names import SAVED_KV_KEY, VLLM_KV_TENSOR
from ..files.content_hash import content_hash
from ..integrations.kv_connector_core import file_metadata, verified_prompt

log = logging.getLogger("peft_softprompt_plus.serve")
# vLLM may run as another user of the front's group: it reads the files, nobody outside the group does.
FILE_MODE = 0o640


def publish(share: str, config: dict, values: torch.Tensor) -> str:
    """`values` (`[layers, 2, Hkv, N, hd]`) of the KV adapter saved with `config` as `share/<hash>.safetensors`, its
    content hash (files/content_hash.py), which is its `cache_salt` too; the config fields the hash counts go in its
    metadata, so vLLM's connector hashes the file again before serving it. A file of that name that doesn't hash to
    it (stale, planted or torn) is replaced, atomically: the connector may read it at any time."""
    data = values.detach().float().cpu().contiguous()
    digest = content_hash(config, {SAVED_KV_KEY: data})  # as saved: its weights file holds this one tensor
    path = os.path.join(share, f"{digest}.safetensors")
    if os.path.exists(path) and _holds(path, digest):
        try:
            os.chmod(path, FILE_MODE)
            return digest
        except OSError:  # another user's file, though right: written again as this front's own
            pass
    handle, scratch = tempfile.mkstemp(dir=share, suffix=".partial")  # mode 0600 until it is complete
    os.close(handle)
    try:
        save_file({VLLM_KV_TENSOR: data}, scratch, metadata=file_metadata(config))
        os.chmod(scratch, FILE_MODE)
        os.replace(scratch, path)
    finally:
        if os.path.exists(scratch):
            os.remove(scratch)
    return digest


def _holds(path: str, digest: str) -> bool:
    """Does the file at `path` hash to `digest`, as the connector checks it (`verified_prompt`)?"""
    try:
        verified_prompt(path, digest)
    except (OSError, ValueError) as err:
        log.warning("replaced %s: %s", path, err)
        return False
    return True


class Share:
    """The share files this front published, and how many requests in flight read each. `named()` gives the hashes
    the served adapters name; a file leaves the share once it is neither named nor read. One front per folder: a
    second one publishing the same adapter would see its file removed by the first."""

    def __init__(self, named: Callable[[], set]):
        self._named = named
        self._lock = threading.Lock()
        self._files: dict[str, str] = {}  # hash -> path, published by this front and still there
        self._reading: Counter = Counter()  # hash -> requests in flight (and adapters being loaded) reading it

    def publish(self, share: str, config: dict, values: torch.Tensor) -> str:
        """`publish`, the file then held until `release`: a file being loaded is not named yet, and must stay."""
        with self._lock:
            digest = publish(share, config, values)
            self._files[digest] = os.path.join(share, f"{digest}.safetensors")
            self._reading[digest] += 1
        return digest

    def hold(self, digest: str) -> bool:
        """A request in flight reads `digest`'s file (False: the file is gone, its adapter removed meanwhile)."""
        with self._lock:
            if digest not in self._files:
                return False
            self._reading[digest] += 1
            return True

    def release(self, digest: Optional[str] = None) -> None:
        """The end of a `hold` or a `publish` on `digest` (None: none), then every file no longer used removed."""
        with self._lock:
            if digest is not None:
                self._reading[digest] -= 1
                if self._reading[digest] <= 0:
                    del self._reading[digest]
            named = self._named()
            for gone in [d for d in self._files if d not in named and d not in self._reading]:
                path = self._files.pop(gone)
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass

    def missing(self, digests) -> list[str]:
        """Those of `digests` whose file is not in the share as this front published it."""
        with self._lock:
            return [d for d in digests if d not in self._files or not os.path.isfile(self._files[d])]

"""The KV share folder behind `softprompt-plus serve --kv-share`: each KV adapter's keys/values as
`<content hash>.safetensors`, checked against that hash before it is served (a file already there is hashed again,
never trusted), readable by the group, written again from memory after the connector refused it, and removed once no
served adapter names it and no request in flight reads it. The folder must be the front's own, closed to others.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch
from safetensors.torch import save_file

from .._names import SAVED_KV_KEY, VLLM_KV_TENSOR
from ..files.content_hash import content_hash
from ..integrations.kv_connector_core import file_metadata, verified_prompt

log = logging.getLogger("peft_softprompt_plus.serve")
# vLLM may run as another user of the front's group: it reads the files, nobody outside the group does.
FILE_MODE = 0o640
FOLDER_MODE = 0o750  # what `softprompt-plus serve` makes a missing --kv-share with: no one outside the group lists it


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
    second one publishing the same adapter would see its file removed by the first.

    The event loop calls `hold` and `release`, which only count under `_lock` (never held across a file operation);
    every write, hash and removal runs in a worker thread under `_files` (so a removal decided by the loop never takes
    away a file published again meanwhile). Each published file's tensor is kept, so `restore` can write it again
    after the connector refused it (torn, removed, replaced)."""

    def __init__(self, named: Callable[[], set]):
        self._named = named
        self._lock = threading.Lock()  # the counts and tables below: held for dict operations only
        self._files_lock = threading.Lock()  # the files themselves: publish, restore, removal
        self._files: dict[str, str] = {}  # hash -> path, published by this front and still there
        self._kept: dict[str, tuple[str, dict, torch.Tensor]] = {}  # hash -> (share, config, values) it holds
        self._reading: Counter = Counter()  # hash -> requests in flight (and adapters being loaded) reading it
        self._sweeper: Optional[ThreadPoolExecutor] = None

    def publish(self, share: str, config: dict, values: torch.Tensor) -> str:
        """`publish`, the file then held until `release`: a file being loaded is not named yet, and must stay."""
        with self._files_lock:
            digest = publish(share, config, values)
            with self._lock:
                self._files[digest] = os.path.join(share, f"{digest}.safetensors")
                self._kept[digest] = (share, config, values.detach().float().cpu())
                self._reading[digest] += 1
        return digest

    def restore(self, digest: str) -> bool:
        """`digest`'s file written again from the tensor this front holds, where it is missing or doesn't hash to its
        name (a blocking call: a worker thread's). False: no served adapter holds it any more."""
        with self._files_lock:
            with self._lock:
                kept = self._kept.get(digest) if digest in self._files else None
            if kept is None:
                return False
            publish(*kept)
        return True

    def hold(self, digest: str) -> bool:
        """A request in flight reads `digest`'s file (False: the file is gone, its adapter removed meanwhile)."""
        with self._lock:
            if digest not in self._files:
                return False
            self._reading[digest] += 1
            return True

    def release(self, digest: Optional[str] = None, wait: bool = False) -> None:
        """The end of a `hold` or a `publish` on `digest` (None: none); then every file no longer used is removed, in
        a worker thread (`wait`: before this returns; the event loop never waits)."""
        with self._lock:
            if digest is not None:
                self._reading[digest] -= 1
                if self._reading[digest] <= 0:
                    del self._reading[digest]
            unused = bool(self._unused())
        if unused:
            if wait:
                self._sweep()
            else:
                self._submit(self._sweep)

    def _unused(self) -> list[str]:
        named = self._named()
        return [d for d in self._files if d not in named and d not in self._reading]

    def _submit(self, job: Callable) -> None:
        with self._lock:
            if self._sweeper is None:
                self._sweeper = ThreadPoolExecutor(1, thread_name_prefix="kv-share")
        self._sweeper.submit(job)

    def _sweep(self) -> None:
        with self._files_lock:
            with self._lock:  # decided again: a file published since it was found unused stays
                gone = [(d, self._files.pop(d)) for d in self._unused()]
                for d, _ in gone:
                    self._kept.pop(d, None)
            for _, path in gone:
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass

    def missing(self, digests) -> list[str]:
        """Those of `digests` whose file is not in the share as this front published it (a blocking call)."""
        with self._lock:
            paths = {d: self._files.get(d) for d in digests}
        return [d for d, path in paths.items() if path is None or not os.path.isfile(path)]


def check_folder(share: str) -> None:
    """Refuse a share folder another user could write to, list or own: vLLM serves whatever `<hash>.safetensors` is
    there (after hashing it), and its names are the adapters' content hashes. vLLM's user reads it through the group
    (docs/serving.md, "KV prompts")."""
    info = os.stat(share)
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != os.geteuid():
        raise ValueError(
            f"`--kv-share`={share!r} belongs to user id {info.st_uid}, not to this front's ({os.geteuid()}): another "
            "user could replace what vLLM reads. Pass a folder of your own (one under /tmp may have been made by "
            "someone else first)."
        )
    if mode & (stat.S_IWGRP | stat.S_IWOTH | stat.S_IROTH):
        raise ValueError(
            f"`--kv-share`={share!r} has mode {mode:o}: others may list it or it is writable beyond its owner. Run "
            f"`chmod 750 {share}` (vLLM's user reads it as a member of the folder's group)."
        )

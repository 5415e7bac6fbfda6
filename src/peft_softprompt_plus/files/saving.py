"""Crash-safe adapter saves: a save writes a sibling staging folder, then swaps it with the target in one atomic
`renameat2(RENAME_EXCHANGE)`. A process killed at any instant leaves the target as the old adapter or the new one,
never a mix; a killed save's staging folder is removed by the next save of the same target."""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import shutil
import tempfile
from typing import Callable, Optional, TypeVar

from .._names import BANK, ENCODER_FILE, RAW_KEY, encoder_state, prompt_key

logger = logging.getLogger(__name__)
T = TypeVar("T")

_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def full_prompt(value, num_virtual_tokens: int, adapter_name: str):
    """The whole float32 prompt for the saved file (`[N, D]`, or a KV prompt's `[layers, 2, Hkv, N, hd]`), or the
    recipe for gathering a sharded one: a shard never reaches the disk as if it were the prompt."""
    import torch

    sharded = type(value).__name__ == "DTensor" or value.dim() not in (2, 5) or value.shape[-2] != num_virtual_tokens
    if sharded:
        local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor's `.shape` is the global one
        raise ValueError(
            f"The prompt of adapter {adapter_name!r} is sharded on this process ({type(value).__name__} of local "
            f"shape {list(local.shape)}, expected {num_virtual_tokens} positions), so saving it would write a "
            "shard. "
            "Gather the full state dict on every rank, then save it on one: with FSDP2, "
            "`sd = torch.distributed.checkpoint.state_dict.get_model_state_dict(model, options=StateDictOptions("
            "full_state_dict=True, cpu_offload=True))`; with FSDP1, `with FSDP.state_dict_type(model, "
            "StateDictType.FULL_STATE_DICT): sd = model.state_dict()`; with DeepSpeed ZeRO-3, "
            "`sd = engine._zero3_consolidated_16bit_state_dict()` (or a GatheredParameters context); then "
            "`model.save_pretrained(path, state_dict=sd, is_main_process=rank == 0)`."
        )
    return value.detach().to(torch.float32).contiguous()


def check_directory(save_directory) -> str:
    """`save_directory` as an absolute real path, or a ValueError naming what is wrong with it."""
    if not isinstance(save_directory, (str, os.PathLike)):
        raise ValueError(
            f"`save_directory` must be a folder path (str or os.PathLike), got {type(save_directory).__name__} "
            f"{save_directory!r}. Pass e.g. model.save_pretrained('my-adapter')."
        )
    path = os.fspath(save_directory)
    if not path.strip():
        raise ValueError(
            f"`save_directory` must name a folder, got {path!r}, which would write into the current directory. Pass "
            "a folder name, e.g. 'my-adapter' (or '.' to mean the current directory on purpose)."
        )
    if os.path.isfile(path):
        raise ValueError(f"`save_directory` must be a directory, got the file {path!r}. Pass a folder path.")
    return os.path.realpath(path)


def _prefix(target: str) -> str:
    return f".{os.path.basename(target)}.softprompt-plus-save-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_leftovers(target: str) -> None:
    """Staging folders of earlier saves of `target` whose process is gone (killed mid-save)."""
    parent, prefix = os.path.dirname(target), _prefix(target)
    for name in os.listdir(parent):
        pid = name[len(prefix) :].split("-", 1)[0]
        if name.startswith(prefix) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _carry_over(target: str, staging: str) -> None:
    """Whatever the target holds that this save doesn't write (a user's files, other adapters' folders, a Trainer's
    checkpoint state) comes along: hard links, so the old folder stays whole until the swap."""
    if not os.path.isdir(target):
        return
    for name in os.listdir(target):
        src, dst = os.path.join(target, name), os.path.join(staging, name)
        if os.path.lexists(dst):
            if os.path.isdir(src) and os.path.isdir(dst) and not os.path.islink(src):
                _carry_over(src, dst)
            continue
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _fsync_tree(root: str) -> None:
    for folder, _dirs, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                os.fsync(handle.fileno())
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@functools.lru_cache(maxsize=None)
def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two existing paths; False where the system or filesystem can't."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), b)


def _replace_files(staging: str, target: str) -> None:
    """Without an atomic swap: weights before config, so a reader that sees the new config finds weights that fit."""
    order = {"adapter_model.safetensors": 0, "adapter_model.bin": 0, "adapter_config.json": 1}
    for root, _dirs, files in os.walk(staging):
        out = os.path.normpath(os.path.join(target, os.path.relpath(root, staging)))
        os.makedirs(out, exist_ok=True)
        for name in sorted(files, key=lambda f: order.get(f, 2)):
            os.replace(os.path.join(root, name), os.path.join(out, name))


def atomic_save(write_into: Callable[[str], T], save_directory) -> T:
    """Run `write_into(staging_folder)`, then make the staging folder `save_directory` in one atomic step.

    A failure while writing (disk full, a bad tensor, a kill) leaves the adapter already on disk untouched.
    """
    target = check_directory(save_directory)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    _remove_leftovers(target)
    staging = tempfile.mkdtemp(prefix=f"{_prefix(target)}{os.getpid()}-", dir=parent)
    try:
        readme = os.path.join(target, "README.md")
        if os.path.isfile(readme):  # PEFT merges into an existing card: seed it, so the user's text survives
            shutil.copy2(readme, os.path.join(staging, "README.md"))
        result = write_into(staging)
        _carry_over(target, staging)
        _fsync_tree(staging)
        if not os.path.exists(target):
            os.rename(staging, target)
        elif not _exchange(staging, target):
            logger.warning(
                "This filesystem can't swap folders atomically; the adapter's files are replaced one by one."
            )
            _replace_files(staging, target)
        return result
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # after a swap it holds the old adapter


def write_beside(peft_model, folder: str, state_dict: Optional[dict]) -> None:
    """After PEFT saved into `folder`: each reparameterised adapter it wrote gets its raw prompt and encoder beside
    the folded table (PEFT's layout: `default` at the top, others in a subfolder of their name)."""
    from safetensors.torch import save_file

    bank = getattr(peft_model.base_model, BANK, None)
    state = state_dict if state_dict is not None else peft_model.state_dict()
    for name in list(getattr(bank, "encoders", {})):
        target = folder if name == "default" else os.path.join(folder, name)
        if not os.path.isfile(os.path.join(target, "adapter_config.json")):
            continue  # not among `selected_adapters`
        raw = next(v for k, v in state.items() if k.endswith(prompt_key(name)))
        tensors = {RAW_KEY: raw, **{f"encoder.{k}": v for k, v in encoder_state(state, name).items()}}
        tensors = {k: v.detach().float().contiguous().cpu() for k, v in tensors.items()}
        save_file(tensors, os.path.join(target, ENCODER_FILE), metadata={"format": "pt"})

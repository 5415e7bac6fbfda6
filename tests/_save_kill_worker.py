"""Kills `save_pretrained` at every filesystem step, and at random instants on a slow filesystem, then loads what is
on disk. Run by tests/files/test_saving.py as `python _save_kill_worker.py BASE_DIR WORK_DIR OUT_JSON`.

Imports happen once; each save runs in a forked child that SIGKILLs itself (or is killed) mid-way, so a kill point
costs a fork rather than an interpreter start.
"""

import json
import os
import random
import shutil
import signal
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from peft import PeftModel, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from peft_softprompt_plus import SoftPromptPlusConfig, saving  # noqa: E402

torch.set_num_threads(1)
BASE, WORK, OUT = sys.argv[1:4]
TARGET = os.path.join(WORK, "adapter")
OLD = os.path.join(WORK, "old-copy")


def adapter(num_virtual_tokens: int, seed: int):
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(BASE),
        SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=num_virtual_tokens, init_seed=seed),
    )
    return model


def load_prompt() -> list:
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), TARGET)
    return loaded.base_model.prompt("default").tolist()


class Counter:
    """Wraps the filesystem calls saving.py makes on its way to the target (renames, links, fsyncs, folder creation,
    the atomic exchange, copies); calls `on_step(n)` before the n-th one."""

    def __init__(self, on_step):
        self.calls, self.on_step = 0, on_step

    def wrap(self, fn):
        def counted(*args, **kwargs):
            self.calls += 1
            self.on_step(self.calls)
            return fn(*args, **kwargs)

        return counted

    def install(self):
        fake_os = type("os", (), {})()
        for name in dir(os):
            setattr(fake_os, name, getattr(os, name))
        for name in ("rename", "replace", "link", "fsync", "makedirs", "mkdir"):
            setattr(fake_os, name, self.wrap(getattr(os, name)))
        saving.os = fake_os
        saving._exchange = self.wrap(saving._exchange)
        saving.shutil.copy2 = self.wrap(saving.shutil.copy2)


def save_in_child(model, on_step) -> int:
    """Fork; the child saves `model` under a Counter and exits; returns the child's wait status."""
    pid = os.fork()
    if pid == 0:
        try:
            Counter(on_step).install()
            model.save_pretrained(TARGET)
        finally:
            os._exit(0)
    return os.waitpid(pid, 0)[1]


def main() -> None:
    old, new = adapter(4, 1), adapter(6, 2)  # a different N, so a mix of old and new files could not pass for either
    old.save_pretrained(TARGET)
    shutil.copytree(TARGET, OLD)
    expected = {"old": old.base_model.prompt("default").tolist(), "new": new.base_model.prompt("default").tolist()}
    total = Counter(lambda n: None)
    total.install()
    new.save_pretrained(TARGET)  # in this process, to learn how many steps a save takes
    steps = total.calls
    outcomes = []

    def kill_at(k):
        def on_step(n):
            if n == k:
                os.kill(os.getpid(), signal.SIGKILL)

        return on_step

    def reset():
        shutil.rmtree(TARGET, ignore_errors=True)
        shutil.copytree(OLD, TARGET)

    for k in range(1, steps + 2):  # every step, and once after the last
        reset()
        status = save_in_child(new, kill_at(k))
        outcomes.append({"kill_at": k, "killed": os.WIFSIGNALED(status), "files": sorted(os.listdir(WORK))})
        outcomes[-1]["prompt"] = load_prompt()
    rng = random.Random(0)
    for trial in range(8):  # random instants on a slow filesystem (every step sleeps 20 ms)
        reset()
        pid = os.fork()
        if pid == 0:
            Counter(lambda n: time.sleep(0.02)).install()
            new.save_pretrained(TARGET)
            os._exit(0)
        time.sleep(rng.uniform(0.0, 0.02 * steps))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        outcomes.append({"kill_at": f"random {trial}", "killed": True, "prompt": load_prompt()})
    # The next save cleans what killed saves left behind.
    new.save_pretrained(TARGET)
    leftovers = [n for n in os.listdir(WORK) if ".softprompt-plus-save-" in n]
    with open(OUT, "w") as handle:
        json.dump({"steps": steps, "expected": expected, "outcomes": outcomes, "leftovers": leftovers}, handle)


if __name__ == "__main__":
    main()

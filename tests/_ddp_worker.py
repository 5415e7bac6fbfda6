"""Worker for tests/integrations/test_distributed.py: trains a soft prompt with the HF `Trainer` under `torchrun` or
`accelerate launch` (gloo, CPU) and writes what this rank ended with to `<out>/rank<R>.pt`."""

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _versions import checkpointing_arg, is_checkpointing  # noqa: E402
from peft import get_peft_model  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

import peft_softprompt_plus  # noqa: E402,F401  (registers the method)
from peft_softprompt_plus import SoftPromptPlusConfig  # noqa: E402
from peft_softprompt_plus.apps.tiny import tiny_gpt2  # noqa: E402

LENGTH = 10


class RecordingTrainer(Trainer):
    """Keeps the token ids each step fed this rank, to prove the ranks trained on different shards."""

    seen: list

    def compute_loss(self, model, inputs, *args, **kwargs):
        self.seen.append(inputs["input_ids"].detach().clone())
        return super().compute_loss(model, inputs, *args, **kwargs)


def dataset(rows: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 300, (rows, LENGTH), generator=g)
    lengths = torch.randint(4, LENGTH + 1, (rows,), generator=g)
    mask = (torch.arange(LENGTH) < lengths[:, None]).long()  # right padding of varying length
    labels = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": i, "attention_mask": m, "labels": lab} for i, m, lab in zip(ids, mask, labels, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--no-find-unused",
        action="store_true",
        help="ddp_find_unused_parameters=False: safe, since the prompt gets a gradient from every forward",
    )
    parser.add_argument("--checkpointing", action="store_true", help="activation (gradient) checkpointing on")
    parser.add_argument("--level", default="input", choices=("input", "kv"), help="the prompt's `prompt_level`")
    args = parser.parse_args()

    # Same seed on every rank: DDP also broadcasts rank 0's parameters, but an identical start keeps that honest.
    config = SoftPromptPlusConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, init_seed=0, prompt_level=args.level)
    model = get_peft_model(tiny_gpt2(seed=0), config)
    initial = model.base_model.prompt("default").detach().clone()
    training_args = TrainingArguments(
        output_dir=os.path.join(args.output_dir, "trainer"),
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        max_steps=args.steps,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        save_strategy="no",
        seed=0,
        ddp_find_unused_parameters=False if args.no_find_unused else None,
        **checkpointing_arg(args.checkpointing),
    )
    trainer = RecordingTrainer(model=model, args=training_args, train_dataset=dataset())
    trainer.seen = []
    trainer.train()

    rank = training_args.process_index
    torch.save(
        {
            "world_size": training_args.world_size,
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
            "checkpointing": is_checkpointing(model.get_base_model()),
            "initial": initial,
            "final": model.base_model.prompt("default").detach().clone(),
            "seen": trainer.seen,
        },
        os.path.join(args.output_dir, f"rank{rank}.pt"),
    )
    if torch.distributed.is_initialized():
        # Without it, gloo's threads can outlive the interpreter's teardown and abort a rank at exit ("terminate
        # called without an active exception"), after its results are written: seen once in CI.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # The results are on disk and the process group is gone; exit without the interpreter's teardown, where a gloo
    # thread still being joined can abort a rank ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

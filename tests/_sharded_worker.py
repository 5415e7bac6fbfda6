"""Worker for tests/integrations/test_sharded.py: trains a soft prompt under sharded data parallelism on the CPU
(gloo, 2 processes under `torchrun`) with a plain torch loop, then saves it twice: `save_pretrained` straight on the
sharded model (which must refuse to write a shard) and the gather recipe the refusal gives. Writes what this rank saw
and ended with to `<out>/rank<R>.pt`.

Modes: `fsdp2` (`fully_shard` per GPT-2 block and at the root of the PeftModel), `fsdp1` (`FullyShardedDataParallel`,
`use_orig_params=True`, one unit per block and the root), `zero2` / `zero3` (DeepSpeed, torch AdamW as the client
optimizer). `train_reference` is the one-process run on the whole global batch that the test compares against."""

import argparse
import datetime
import functools
import os
import sys
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from peft import get_peft_model  # noqa: E402

import peft_softprompt_plus  # noqa: E402,F401  (registers the method)
from peft_softprompt_plus import SoftPromptPlusConfig  # noqa: E402
from peft_softprompt_plus.apps.tiny import tiny_gpt2  # noqa: E402

NUM_VIRTUAL_TOKENS = 4
LENGTH = 10
GLOBAL_BATCH = 4  # rows per step over all ranks; each of the 2 ranks trains on its contiguous half
STEPS = 3
LR = 1e-2
MODES = ("fsdp2", "fsdp1", "zero2", "zero3")


def make_model(forward_path: str = "auto", level: str = "input"):
    """The same seeded start on every rank and in the reference."""
    config = SoftPromptPlusConfig(
        task_type="CAUSAL_LM",
        num_virtual_tokens=NUM_VIRTUAL_TOKENS,
        init_seed=0,
        forward_path=forward_path,
        prompt_level=level,
        kv_frozen_positions=1 if level == "kv" else None,  # a frozen sink rides along with the trained positions
    )
    return get_peft_model(tiny_gpt2(seed=0), config).train()


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` fixed global batches of `(input_ids, attention_mask)`, right padded to varying lengths."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(2, 300, (GLOBAL_BATCH, LENGTH), generator=g)
        lengths = torch.randint(4, LENGTH + 1, (GLOBAL_BATCH,), generator=g)
        out.append((ids, (torch.arange(LENGTH) < lengths[:, None]).long()))
    return out


def eval_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 300, (3, LENGTH), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids, mask


def loss_of(logits, ids, mask, global_mask, world_size: int) -> torch.Tensor:
    """Next-token cross entropy summed over this rank's tokens, divided by the token count of the whole global batch
    and multiplied by the world size: after the averaging all-reduce (or reduce-scatter) of the gradients, every rank
    holds the gradient of the global batch's token mean, as one process on the whole batch would. (A per-rank mean
    would weigh the ranks' tokens unequally when their padding differs.)"""
    labels = ids.masked_fill(mask == 0, -100)[:, 1:]
    total = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return total / global_mask[:, 1:].sum() * world_size


def train_reference(steps: int = STEPS, forward_path: str = "auto", level: str = "input"):
    """One process, the whole global batch per step, same loop: `(model, [loss per step])`."""
    torch.manual_seed(0)
    model = make_model(forward_path, level)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for ids, mask in batches(steps):
        loss = loss_of(model(input_ids=ids, attention_mask=mask).logits, ids, mask, mask, 1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


def _shard(mode: str, model):
    """`(what to call forward on, the PeftModel, the optimizer or None when DeepSpeed steps)`."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.base_model.model.transformer.h:
            fully_shard(block)
        fully_shard(model)  # the root group holds the embeddings, the final norm and the prompt
        params = [p for p in model.parameters() if p.requires_grad]  # DTensors now
        return model, model, torch.optim.AdamW(params, lr=LR)
    if mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        # `device_id` cpu: without it FSDP1 looks for an accelerator and refuses to start on a CPU-only machine.
        wrapped = FSDP(
            model,
            use_orig_params=True,
            auto_wrap_policy=ModuleWrapPolicy({GPT2Block}),
            device_id=torch.device("cpu"),
        )
        params = [p for p in wrapped.parameters() if p.requires_grad]
        return wrapped, model, torch.optim.AdamW(params, lr=LR)
    import deepspeed

    # ZeRO-3 keeps parameters under `stage3_param_persistence_threshold` (1e5 elements) whole on every rank; 0
    # partitions even this tiny prompt, as a real one of `N x hidden` > 1e5 elements would be.
    zero = {"stage": 2} if mode == "zero2" else {"stage": 3, "stage3_param_persistence_threshold": 0}
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dist.get_world_size(),
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch AdamW: DeepSpeed's fused CPU Adam would need a compiled op
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trainable, lr=LR), config=config)
    return engine, model, None


def _full_state_dict(mode: str, wrapped) -> dict:
    """The gather recipe of the library's refusal message, per mode."""
    if mode == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT):
            return wrapped.state_dict()
    if mode == "zero3":
        return wrapped._zero3_consolidated_16bit_state_dict()
    return wrapped.module.state_dict()  # ZeRO-2 partitions optimizer state and gradients, never the parameters


def _attempt(fn):
    """`(result, None)` or `(None, {"type", "message", "traceback"})`: the test asserts on what failed, and how."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001  (recorded for the test to judge)
        return None, {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--forward-path", default="auto", choices=("auto", "shared_kv", "concat"))
    parser.add_argument("--level", default="input", choices=("input", "kv"))
    args = parser.parse_args()

    timeout = datetime.timedelta(seconds=120)  # a rank left waiting on a collective fails instead of hanging
    if args.mode.startswith("zero"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)

    torch.manual_seed(0)
    model = make_model(args.forward_path, args.level)
    initial = model.base_model.prompt("default").detach().clone()
    wrapped, peft_model, optimizer = _shard(args.mode, model)

    losses = []
    for ids, mask in batches(args.steps):
        outputs, forward_error = _attempt(functools.partial(wrapped, input_ids=ids[rows], attention_mask=mask[rows]))
        if forward_error is not None:  # a refused forward path: the test reads the message
            torch.save({"forward_error": forward_error}, os.path.join(args.output_dir, f"rank{rank}.pt"))
            # Every rank refuses alike; meet before tearing gloo down, or a rank that is still sending aborts
            # ("terminate called without an active exception", seen once in CI).
            dist.barrier()
            dist.destroy_process_group()
            return
        loss = loss_of(outputs.logits, ids[rows], mask[rows], mask, world_size)
        if optimizer is None:
            wrapped.backward(loss)
            wrapped.step()
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())

    local = peft_model.base_model.prompt("default")
    local_type = type(local).__name__
    # What this rank holds of the prompt: a DTensor's `.shape` is the global one; ZeRO-3 keeps its shard aside.
    shard = local.to_local() if local_type == "DTensor" else getattr(local, "ds_tensor", local)
    local_shape, held_shape = list(shard.shape), list(local.data.shape)

    # (a) `save_pretrained` straight on the sharded model: every rank calls it, as a training script would.
    direct = os.path.join(args.output_dir, "direct")
    _, direct_error = _attempt(lambda: peft_model.save_pretrained(direct))
    dist.barrier()

    # (b) the recipe: gather the full state dict on every rank, save on rank 0.
    state_dict, gather_error = _attempt(lambda: _full_state_dict(args.mode, wrapped))
    state_dict = state_dict or {}
    recipe = os.path.join(args.output_dir, "recipe")
    _, recipe_error = (
        _attempt(lambda: peft_model.save_pretrained(recipe, state_dict=state_dict, is_main_process=rank == 0))
        if gather_error is None
        else (None, None)
    )
    dist.barrier()

    prompt_keys = [k for k in state_dict if "softprompt_plus_prompt" in k]
    gathered = state_dict[prompt_keys[0]].detach().to(torch.float32).clone() if prompt_keys else None
    torch.save(
        {
            "forward_error": None,
            "world_size": world_size,
            "backend": dist.get_backend(),
            "rows": (rows.start, rows.stop),
            "initial": initial,
            "losses": losses,
            "local_type": local_type,
            "local_shape": local_shape,
            "held_shape": held_shape,
            "direct_error": direct_error,
            "gather_error": gather_error,
            "recipe_error": recipe_error,
            "state_dict_size": len(state_dict),
            "prompt_keys": prompt_keys,
            "gathered": gathered,
            "kernels": sorted(peft_model.base_model.forward_state.last_kernels),
        },
        os.path.join(args.output_dir, f"rank{rank}.pt"),
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The results are on disk and the process group is gone; exit without the interpreter's teardown, where a gloo
    # thread still being joined once aborted a rank ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""Dtype rules beside the float32 prompt: a trainable `modules_to_save` copy on a low-precision base is lifted to
float32 and casts its own input, so GradScaler and small updates work as they do for the prompt."""

from __future__ import annotations

import torch
from torch import nn


def _input_to_own_dtype(module: nn.Module, args: tuple) -> tuple:
    dtype = next(module.parameters()).dtype  # read per call: `.half()` after attach lowers the module again
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def lift_to_float32(module: nn.Module) -> None:
    """Float32 weights for a trainable copy fed by a low-precision base; it casts its own input. Idempotent."""
    for param in module.parameters():
        if param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.float()
    if not getattr(module, "_softprompt_plus_casts_input", False):
        module.register_forward_pre_hook(_input_to_own_dtype)
        module._softprompt_plus_casts_input = True

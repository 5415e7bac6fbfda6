"""Residual reparameterisation of a prompt (Razdaibiedina et al., 2023, "Residual Prompt Tuning"): while training,
every `[D]` row goes through one shared MLP with a skip connection, `P' = P + LayerNorm(up(relu(down(P))))`. Only the
folded `[N, D]` table is the adapter; saving.py writes the raw prompt and the encoder beside it (`ENCODER_FILE`) and
loading.py reads them back, so training can resume."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .prompt_init import embedding_stats


class ResidualEncoder(nn.Module):
    """`[N, D] -> [N, D]`: the prompt plus a bottleneck MLP of it (one MLP shared by every row)."""

    def __init__(self, dim: int, hidden: int, layer_norm: bool, scale: float) -> None:
        super().__init__()
        self.down = nn.Linear(dim, hidden)
        self.up = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim) if layer_norm else nn.Identity()
        if layer_norm:
            # A LayerNorm's rows have unit variance, ~1/std times a word embedding's; at gain 1 the branch would
            # swamp the prompt's initial values (7.5x SmolLM2's row norm). Starting the gain at the embeddings'
            # std keeps P' on the embeddings' scale, as prompt_init's `random` does.
            nn.init.constant_(self.norm.weight, scale)

    def forward(self, prompt: torch.Tensor) -> torch.Tensor:
        return prompt + self.norm(self.up(torch.relu(self.down(prompt))))  # [N, D]


def encoder_for(config, embedding: nn.Embedding) -> Optional[ResidualEncoder]:
    """The float32 encoder `config` asks for, on the embedding's device; None for a plain prompt."""
    if str(config.reparameterization) != "residual":
        return None
    std = embedding_stats(embedding)[1]
    # Seeded by `init_seed` like the prompt itself, without touching the caller's generator.
    with torch.random.fork_rng(devices=[]):
        if config.init_seed is not None:
            torch.manual_seed(config.init_seed)
        encoder = ResidualEncoder(embedding.embedding_dim, config.residual_hidden, config.residual_layer_norm, std)
    return encoder.to(device=embedding.weight.device, dtype=torch.float32)


@torch.no_grad()
def fold(raw: torch.Tensor, encoder_state: dict, layer_norm: bool) -> torch.Tensor:
    """The folded `[N, D]` table from tensors alone (a state dict, e.g. while saving): `encoder(raw)`."""
    hidden, dim = encoder_state["down.weight"].shape
    # The module's own forward on the saved tensors, so the folded table equals what training read; built on the meta
    # device, it allocates nothing and draws nothing from the caller's generator.
    with torch.device("meta"):
        encoder = ResidualEncoder(dim, hidden, layer_norm, scale=1.0)
    return torch.func.functional_call(encoder, encoder_state, (raw,))  # [N, D]

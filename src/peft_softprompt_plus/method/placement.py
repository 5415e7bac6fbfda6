"""Where the soft tokens sit: a fixed hard prefix and suffix of real tokens around them (`prompt_prefix`,
`prompt_suffix`), e.g. BOS before them, or a chat template's system header before and its end of turn after, so the
soft tokens sit where a system prompt sits.

The hard parts are token ids stored in the adapter's config (resolved from text once, at attach, so loading needs no
tokenizer) and frozen. `around` puts them on either side of the soft rows, so every path that reads the prompt
(the once-per-batch prompt pass, generate, mixed-adapter batches, the attach probe, `prompt_embeds` for serving)
reads `[prefix; soft; suffix]` as one prompt of P+N+S positions.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

Config = Any  # a SoftPromptPlusConfig (config.py imports this module through its checks)


_PARTS = ("prefix", "suffix")


def _ids_problem(name: str, ids) -> Optional[str]:
    well_formed = isinstance(ids, (list, tuple)) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    )
    if ids is not None and not (well_formed and ids):
        return f"`{name}` must be a non-empty list of token ids (ints >= 0) or None, got {ids!r}."
    return None


def check(config: Config) -> Optional[str]:
    """The config check for the four placement fields (run on construction, before any tokenizer is loaded)."""
    problems = []
    for part in _PARTS:
        text, ids = getattr(config, f"prompt_{part}"), getattr(config, f"prompt_{part}_ids")
        if text is not None and not (isinstance(text, str) and text):
            problems.append(f"`prompt_{part}` must be a non-empty string or None, got {text!r}.")
        problems.append(_ids_problem(f"prompt_{part}_ids", ids))
        if text is not None and ids is None and not config.tokenizer_name_or_path:
            problems.append(
                f"`prompt_{part}`={text!r} needs `tokenizer_name_or_path` to be tokenized, got "
                f"{config.tokenizer_name_or_path!r}. Pass the base model's tokenizer (a local directory), or the ids "
                f"as `prompt_{part}_ids`."
            )
    return " ".join(p for p in problems if p) or None


def resolve(config: Config, embedding: nn.Embedding) -> None:
    """At attach: tokenize a `prompt_prefix`/`prompt_suffix` text into its stored ids, refusing text the tokenizer
    can't reproduce (it would not be the text the user wrote), and ids outside the model's vocabulary."""
    tokenizer = None
    for part in _PARTS:
        text, name = getattr(config, f"prompt_{part}"), f"prompt_{part}_ids"
        if text is not None and getattr(config, name) is None:
            if tokenizer is None:
                from .prompt_init import load_tokenizer

                tokenizer = load_tokenizer(config, f"`prompt_{part}`")
            setattr(config, name, _tokenized(tokenizer, f"prompt_{part}", text))
        ids = getattr(config, name) or []
        outside = [i for i in ids if i >= embedding.num_embeddings]
        if outside:
            raise ValueError(
                f"`{name}`={ids!r} holds ids {outside} outside the model's vocabulary of {embedding.num_embeddings}: "
                "they come from another model's tokenizer. Tokenize with this model's tokenizer."
            )


def _tokenized(tokenizer, name: str, text: str) -> list[int]:
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    unknown = getattr(tokenizer, "unk_token_id", None)
    if not ids or back != text or (unknown is not None and unknown in ids):
        raise ValueError(
            f"`{name}`={text!r} can't be reproduced by the tokenizer: it encodes to {ids} ({len(ids)} tokens), which "
            f"decode to {back!r}. Write the text as the tokenizer spells it (its special tokens included), or pass "
            f"the ids as `{name}_ids`."
        )
    return ids


def hard_ids(config: Config) -> tuple[list[int], list[int]]:
    """(prefix ids, suffix ids), each possibly empty."""
    return list(config.prompt_prefix_ids or []), list(config.prompt_suffix_ids or [])


def length(config: Config) -> int:
    """P+N+S: the positions the whole prompt takes in front of the text."""
    prefix, suffix = hard_ids(config)
    return len(prefix) + config.num_virtual_tokens + len(suffix)


def around(soft: torch.Tensor, embedding: nn.Embedding, config: Config) -> torch.Tensor:
    """`[prefix; soft; suffix]` `[P+N+S, D]` in `soft`'s dtype: the hard rows are what the embedding module makes of
    their ids (Gemma scales inside it), computed without a graph (they are frozen); the soft rows keep theirs."""
    prefix, suffix = hard_ids(config)
    if not prefix and not suffix:
        return soft  # [N, D]
    with torch.no_grad():
        hard = {
            part: embedding(torch.tensor(ids, dtype=torch.long, device=embedding.weight.device)).to(soft.dtype)
            for part, ids in (("prefix", prefix), ("suffix", suffix))
            if ids
        }
    parts = [hard.get("prefix"), soft, hard.get("suffix")]
    return torch.cat([p.to(soft.device) for p in parts if p is not None])  # [P+N+S, D]


def refuse_second_bos(configs: dict, adapters: list[str], rows, input_ids, attention_mask, bos_id) -> None:
    """A row whose text starts with BOS while its adapter's prefix already starts with BOS would read it twice:
    refused, naming the row and the fix (the one BOS the model saw in training is the prefix's). A text holding the
    BOS id more than once uses it to open turns (ChatML templates whose `<|im_start|>` is the BOS), not to start the
    document: that text starts a turn, and is left alone. `rows[b]` indexes `adapters` (None: every row reads 0)."""
    if bos_id is None or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return
    with_bos = [i for i, a in enumerate(adapters) if (configs[a].prompt_prefix_ids or [None])[0] == bos_id]
    if not with_bos:
        return
    batch, device = input_ids.shape[0], input_ids.device
    two_d = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
    real = attention_mask.to(device).bool() if two_d else torch.ones_like(input_ids, dtype=torch.bool)  # [B, L]
    first = real.long().argmax(dim=1)  # [B] the first real position (under left padding)
    bos = (input_ids == bos_id) & real  # [B, L]
    document_start = bos.gather(1, first[:, None]).squeeze(1) & (bos.sum(dim=1) == 1)  # [B]
    adapter_of = torch.zeros(batch, dtype=torch.long) if rows is None else rows.repeat_interleave(batch // len(rows))
    reads_bos = torch.isin(adapter_of, torch.tensor(with_bos, device=adapter_of.device)).to(device)  # [B]
    doubled = (document_start & reads_bos).nonzero().flatten().tolist()
    if doubled:
        name = adapters[int(adapter_of[doubled[0]])]
        raise ValueError(
            f"`input_ids` row {doubled[0]} starts with the BOS token (id {bos_id}), and adapter {name!r} already puts "
            f"BOS in front of its soft tokens (prompt_prefix_ids={configs[name].prompt_prefix_ids}): the model would "
            "read it twice. Tokenize the text without it (`add_special_tokens=False`), or drop BOS from the prefix."
        )

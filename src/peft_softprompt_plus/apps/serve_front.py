"""What `softprompt-plus serve` does before and after HTTP: the base, its tokenizer and the adapters by name, each
request's text formatted the way its adapter was trained, and the `[N+L, D]` sequence vLLM reads as `prompt_embeds`.

Clients send text; the embeddings are built here, from the adapters this process loaded, and only sent upstream.
"""

from __future__ import annotations

import base64
import io
import os
import threading
from dataclasses import dataclass
from typing import Optional

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..distill.data import student_text
from ..files.inspect_adapter import read_adapter
from ..integrations.serving import prompt_embeds


class FrontError(Exception):
    """A request or an adapter the front refuses: `status` is the HTTP status the client gets."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Adapter:
    name: str
    folder: str
    num_virtual_tokens: int
    chat_format: str  # "template" or "student"
    positions: int = 0  # what the whole prompt takes in front of the text: hard prefix + N + hard suffix
    first_hard: Optional[int] = None  # the prefix's first id (a BOS there means the text must not bring its own)


class Front:
    """The base model with every adapter loaded into one PeftModel; a lock keeps adapter changes and embedding
    builds from meeting (the model is only read to build embeddings: vLLM runs the forward)."""

    def __init__(self, base: str, dtype: str = "float32"):
        self.base_path = base
        self.base_name = os.path.basename(os.path.normpath(base)) or base
        self.tokenizer = AutoTokenizer.from_pretrained(base)
        self.base = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype)).eval()
        self.model: Optional[PeftModel] = None
        self.adapters: dict[str, Adapter] = {}
        self.lock = threading.Lock()
        self.max_positions = getattr(self.base.config, "max_position_embeddings", None)

    # ------------------------------------------------------------------ adapters

    def add(self, name: str, folder: str) -> Adapter:
        """Load (or replace) adapter `name` from `folder`; refused if it was made for another base or width."""
        if not name or name == self.base_name or "/" in name:
            raise FrontError(400, f"adapter name {name!r} is taken or invalid: use a name other than the base's.")
        try:
            config, prompt = read_adapter(folder)  # [N, D], checked as a SOFTPROMPT_PLUS adapter
        except (ValueError, OSError) as err:
            raise FrontError(400, str(err)) from err
        if config.get("prompt_level") == "kv":
            raise FrontError(
                400,
                f"adapter {name!r} ({folder}) is a KV prompt (prompt_level='kv'): vLLM takes a prompt as embeddings, "
                "from which it computes every layer's keys itself, so this front can't serve one. Serve it with the "
                "library's `generate`.",
            )
        self._check_fits(name, folder, config, prompt.shape[-1])
        with self.lock:
            if self.model is None:
                self.model = PeftModel.from_pretrained(self.base, folder, adapter_name=name)
            else:
                if name in self.model.peft_config:
                    self.model.delete_adapter(name)
                self.model.load_adapter(folder, adapter_name=name)
            self.model.eval()
            chat = config.get("chat_format") or "template"
            n = int(config["num_virtual_tokens"])
            hard = len(config.get("prompt_prefix_ids") or []) + len(config.get("prompt_suffix_ids") or [])
            first = (config.get("prompt_prefix_ids") or [None])[0]
            self.adapters[name] = Adapter(name, folder, n, chat, n + hard, first)
        return self.adapters[name]

    def remove(self, name: str) -> None:
        with self.lock:
            if name not in self.adapters:
                raise FrontError(404, f"adapter {name!r} is not served here; serving {sorted(self.adapters)}.")
            del self.adapters[name]
            self.model.delete_adapter(name)

    def _check_fits(self, name: str, folder: str, config: dict, width: int) -> None:
        trained_on = config.get("base_model_name_or_path") or ""
        other = os.path.basename(os.path.normpath(trained_on)) if trained_on else ""
        if other and other != self.base_name:
            raise FrontError(
                400,
                f"adapter {name!r} ({folder}) was trained on {trained_on!r}, not on this server's base "
                f"{self.base_path!r}. Serve it with a front started on that base.",
            )
        if width != self.base.config.hidden_size:
            raise FrontError(
                400,
                f"adapter {name!r} ({folder}) holds a prompt {width} wide, but this base's hidden size is "
                f"{self.base.config.hidden_size}: it was trained on another model.",
            )

    # ------------------------------------------------------------------ requests

    def resolve(self, model: str) -> Optional[Adapter]:
        """The adapter a request's `model` names, or None for the base by its own name."""
        if model == self.base_name or model == self.base_path:
            return None
        if model not in self.adapters:
            raise FrontError(
                404,
                f"model {model!r} is not served here; serving the base {self.base_name!r} and adapters "
                f"{sorted(self.adapters)}.",
            )
        return self.adapters[model]

    def chat_text(self, adapter: Optional[Adapter], messages: list) -> str:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise FrontError(400, "`messages` must be a list of {role, content} objects.")
        if adapter is not None and adapter.chat_format == "student":
            return student_text(self.tokenizer, messages)  # never the template's default system prompt
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def token_ids(self, text: str, adapter: Optional[Adapter] = None) -> list[int]:
        """A completion prompt's ids as the tokenizer makes them, without the BOS it adds when the adapter's own
        prefix already starts with BOS (the model would read it twice)."""
        if not isinstance(text, str) or not text:
            raise FrontError(400, f"`prompt` must be non-empty text, got {text!r}.")
        ids = self.tokenizer(text)["input_ids"]
        bos = self.tokenizer.bos_token_id
        if adapter is not None and bos is not None and adapter.first_hard == bos and ids[:1] == [bos]:
            return ids[1:]
        return ids

    def check_length(self, adapter: Optional[Adapter], ids: list[int], max_tokens: int) -> None:
        n = adapter.positions if adapter is not None else 0
        if self.max_positions is not None and n + len(ids) + max_tokens > self.max_positions:
            raise FrontError(
                400,
                f"the request needs {n + len(ids) + max_tokens} positions (the prompt's {n}, the input's {len(ids)}, "
                f"max_tokens {max_tokens}), but the model has {self.max_positions}. Shorten the input or lower "
                "max_tokens.",
            )

    def embeds_b64(self, adapter: Adapter, ids: list[int]) -> str:
        """The row's exact `[N+L, D]` sequence, as vLLM's server reads it: base64 of its `torch.save` bytes."""
        with self.lock, torch.no_grad():
            row = prompt_embeds(self.model, torch.tensor([ids]), adapter_name=adapter.name)[0]  # [N+L, D]
        buffer = io.BytesIO()
        torch.save(row.cpu().contiguous(), buffer)
        return base64.b64encode(buffer.getvalue()).decode("ascii")

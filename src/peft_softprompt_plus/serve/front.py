"""What `softprompt-plus serve` does before and after HTTP: the base, its tokenizer and the adapters by name, each
request's text formatted the way its adapter was trained, and the `[N+L, D]` sequence vLLM reads as `prompt_embeds`.

Clients send text; the embeddings are built here, from the adapters this process loaded, and only sent upstream.
Each served adapter is an immutable `Adapter` record holding its `[P+N+S, D]` block: a request reads one record
once, so an adapter replaced meanwhile never mixes its old format with its new prompt, and building a request's
embeddings takes no lock. Everything here is blocking work: the HTTP layer calls it from worker threads.
"""

from __future__ import annotations

import base64
import io
import json
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from jinja2 import TemplateError
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from .._names import SAVED_KEY
from ..distill.data import student_text
from ..files.content_hash import content_hash
from ..files.inspect_adapter import read_adapter
from . import fit, kv_fields
from .compose import Compositions
from .embeds import prompt_block, text_embeddings
from .requests import Call, FrontError, Limits, check_adapter_name
from .salts import Salts
from .share import Share, check_folder


@dataclass(frozen=True)
class Adapter:
    name: str
    folder: str
    num_virtual_tokens: int
    chat_format: str  # "template" or "student"
    positions: int  # what the prompt takes in front of the text: hard prefix + N + hard suffix (KV: N)
    content: str  # its content hash (files/content_hash.py): its `cache_salt` derives from it (salts.py)
    block: Optional[torch.Tensor] = None  # [P+N+S, D] an input prompt's prefix, soft rows and suffix
    kv: Optional[str] = None  # a KV prompt: its content hash, the file vLLM's connector reads (kv_fields.py)
    first_hard: Optional[int] = None  # the prefix's first id (a BOS there means the text must not bring its own)
    kv_values: Optional[torch.Tensor] = None  # [layers, 2, Hkv, N, hd] a KV adapter's keys/values as trained
    kv_start: Optional[int] = None  # where its text starts (`kv_text_start`) for `kv_values`
    folded_from: Optional[int] = None  # the text start the published keys were folded from to N (None: not moved)
    parts: tuple[str, ...] = ()  # a composition's KV adapters, in order (`--compose`)


@dataclass(frozen=True)
class Outgoing:
    """A request as it goes to vLLM: the adapter it names (None: the base), the `cache_salt` its bodies carry, and the
    bodies."""

    adapter: Optional[Adapter]
    salt: Optional[str]
    payloads: list[bytes]


class Front:
    """The base model, its tokenizer and the served adapters. One PeftModel holds only the adapter being built
    (`_build_lock`); the served adapters are records swapped in whole (`_lock`), so removing one never waits for a
    build, and a failed build leaves the served one as it was."""

    def __init__(
        self,
        base: str,
        dtype: str = "float32",
        limits: Optional[Limits] = None,
        engine_scales: bool = False,
        kv_share: Optional[str] = None,
    ):
        self.base_path = base
        self.base_name = os.path.basename(os.path.normpath(base)) or base
        self.tokenizer = AutoTokenizer.from_pretrained(base)
        self.base = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype)).eval()
        self.embedding = self.base.get_input_embeddings()
        self.limits = limits or Limits()
        self.engine_scales = engine_scales  # does the engine multiply embeddings by the model's scale itself?
        self.kv_share = kv_share  # where KV prompts are published for vLLM's connector (None: KV adapters refused)
        if kv_share is not None:
            check_folder(kv_share)
        self.salts = Salts()  # each adapter's `cache_salt`, secret, moved after a request ran without its KV prompt
        self.model: Optional[PeftModel] = None
        self.adapters: dict[str, Adapter] = {}
        self.engine = fit.engine_shape(self.base.config)  # the model vLLM serves, as vLLM reads it
        self._lock = threading.Lock()
        self.share = Share(named=lambda: {a.kv for a in self.adapters.values()})  # KV prompts' files
        self.compositions = Compositions(self.share, kv_share, self.base.config, self.base_name)  # `--compose`
        self._build_lock = threading.Lock()
        self.max_positions = getattr(self.base.config, "max_position_embeddings", None)
        # A KV prompt's N positions go upstream as this id: the connector fills their keys/values before they run.
        self.placeholder = next(
            i for i in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0) if i is not None
        )

    # ------------------------------------------------------------------ adapters

    def add(self, name: str, folder: str) -> Adapter:
        """Build adapter `name` from the local `folder`, then serve it (replacing one of that name). Refused if it
        was made for another base or width; a refusal leaves what is served unchanged."""
        check_adapter_name(name, self.base_name)
        if not isinstance(folder, str) or not os.path.isdir(folder):
            raise FrontError(
                400, f"`path`={folder!r} is not a folder on the server: adapters load from local folders only."
            )
        try:
            config, prompt = read_adapter(folder)  # [N, D], checked as a SOFTPROMPT_PLUS adapter
        except (ValueError, OSError) as err:
            raise FrontError(400, str(err)) from err
        kv = config.get("prompt_level") == "kv"
        if kv and self.kv_share is None:
            raise FrontError(400, kv_fields.refusal(name, folder))
        fit.check_base(name, folder, config, self.base_name, self.base.config.hidden_size, prompt, kv)
        if kv:  # before vLLM's connector ever sees it
            fit.check_shape(name, folder, config, tuple(prompt.shape), self.engine)
            fit.check_foldable(name, folder, config, self.base.config)
        with self._build_lock:
            values = self._build(folder, kv)
        n = int(config["num_virtual_tokens"])
        chat = config.get("chat_format") or "template"
        if kv:
            start = config.get("kv_text_start") or n
            served, folded_from = fit.at_n(values, start, self.base.config)  # vLLM puts the text at N
            saved = config if folded_from is None else {**config, "kv_text_start": n}
            digest = self.share.publish(self.kv_share, saved, served)  # held until it is swapped in
            kept = dict(kv_values=values, kv_start=start, folded_from=folded_from)
            adapter = Adapter(name, folder, n, chat, n, digest, kv=digest, **kept)
        else:
            first = (config.get("prompt_prefix_ids") or [None])[0]
            content = content_hash(config, {SAVED_KEY: prompt})  # the saved prompt: the block's rows beside it are ids
            adapter = Adapter(name, folder, n, chat, values.shape[0], content, values, first_hard=first)
        held = [adapter.kv]
        try:
            with self._lock:  # with the compositions that name it rebuilt (compose.py)
                self.adapters = self.compositions.replaced(name, adapter, self.adapters, held)
        finally:
            self.compositions.release(held)  # and the files of what was replaced, unless a request reads them
        return adapter

    def compose(self, name: str, parts) -> Adapter:
        """Serve the loaded KV adapters `parts` composed, under `name` (`--compose NAME=a,b`)."""
        held: list = []
        try:
            with self._lock:
                self.adapters = self.compositions.added(name, parts, self.adapters, held)
                adapter = self.adapters[name]
        finally:
            self.compositions.release(held)
        return adapter

    def _build(self, folder: str, kv: bool) -> torch.Tensor:
        """The folder's `[P+N+S, D]` block (a KV prompt: its `[layers, 2, Hkv, N, hd]` keys/values), read through
        this library's own model, so it is what `generate` reads (and a KV prompt's base is checked)."""
        staging = f"staging-{uuid.uuid4().hex}"
        try:
            if self.model is None:
                self.model = PeftModel.from_pretrained(self.base, folder, adapter_name=staging)
            else:
                self.model.load_adapter(folder, adapter_name=staging)
        except (ValueError, OSError, KeyError, RuntimeError) as err:
            raise FrontError(400, f"the adapter in {folder!r} can't be loaded: {err}") from err
        # The model keeps the last block's adapter only (PEFT can't drop its last one): the others go now.
        self.model.set_adapter(staging)
        for old in [n for n in self.model.peft_config if n != staging]:
            self.model.delete_adapter(old)
        self.model.eval()
        if kv:
            return self.model.base_model.prompt_bank.values(staging).detach().float()
        return prompt_block(self.model, staging, self.engine_scales).cpu().contiguous()

    def remove(self, name: str) -> None:
        with self._lock:
            if name not in self.adapters:
                raise FrontError(404, f"adapter {name!r} is not served here: GET /v1/models lists what is.")
            self.adapters = self.compositions.removed(name, self.adapters)
        self.share.release(wait=True)  # a worker thread: the file goes before the DELETE answers

    # ------------------------------------------------------------------ requests

    def resolve(self, model: str) -> Optional[Adapter]:
        """The adapter record a request's `model` names (read once), or None for the base by its own name."""
        if model in (self.base_name, self.base_path):
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            raise FrontError(404, f"model {model!r} is not served here: GET /v1/models lists what is.")
        return adapter

    def bodies(
        self,
        call: Call,
        upstream_model: str,
        max_model_len: Optional[int],
        reserve: Optional[Callable[[Optional[Adapter], list[int]], None]] = None,
    ) -> Outgoing:
        """The adapter `call` names, the salt its bodies carry, and one vLLM `/v1/completions` body per prompt of
        `call`, as JSON bytes. `reserve(adapter, lengths)` is told each prompt's text length before any embedding is
        built (it raises to refuse them: `--max-prompt-bytes-in-flight`, ops.py)."""
        adapter = self.resolve(call.model)
        if call.route == "chat":
            rows = [self._chat_ids(adapter, call.prompts[0])]
        else:
            many = len(call.prompts) > 1
            rows = [self._completion_ids(adapter, p, i if many else None) for i, p in enumerate(call.prompts)]
        known = [x for x in (self.max_positions, max_model_len) if x is not None]
        limit = min(known) if known else None
        if reserve is not None:
            reserve(adapter, [len(ids) for ids in rows])
        salt = self.salts.current(adapter.content) if adapter is not None else None
        out = []
        for ids in rows:
            body = {**call.options, "model": upstream_model, "max_tokens": self._max_tokens(call, adapter, ids, limit)}
            fit.check_window(adapter, self.base.config, len(ids) + body["max_tokens"])
            if adapter is None:
                if not ids:
                    raise FrontError(400, "the prompt is empty: send some text (the base has no soft prompt to read).")
                body["prompt"] = ids
            elif adapter.kv is not None:
                body.update(kv_fields.fields(adapter.kv, adapter.positions, self.placeholder, ids))
            else:
                body["prompt_embeds"] = self._embeds_b64(adapter, ids)
            if salt is not None:  # tenants never share cache blocks (for KV, the placeholders are the same ids)
                body["cache_salt"] = salt
            out.append(json.dumps(body).encode())
        return Outgoing(adapter, salt, out)

    def _max_tokens(self, call: Call, adapter: Optional[Adapter], ids: list[int], limit: Optional[int]) -> int:
        used = (adapter.positions if adapter is not None else 0) + len(ids)
        room = None if limit is None else limit - used
        if room is not None and room < 1:
            raise FrontError(
                400,
                f"the input takes {used} positions (the adapter's {used - len(ids)}, the text's {len(ids)}), and the "
                f"model has {limit}: no room is left for an answer. Shorten the input.",
            )
        if call.max_tokens is None:
            default = self.limits.default_max_tokens_for(call.route)
            return default if room is None else min(default, room)
        if room is not None and call.max_tokens > room:
            raise FrontError(
                400,
                f"the request needs {used + call.max_tokens} positions (the adapter's {used - len(ids)}, the "
                f"input's {len(ids)}, max_tokens {call.max_tokens}), but the model has {limit}. Shorten the input or "
                f"lower max_tokens to at most {room}.",
            )
        return call.max_tokens

    def _chat_ids(self, adapter: Optional[Adapter], messages: list) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise FrontError(400, f"the base {self.base_name!r} has no chat template: use /v1/completions.")
        if adapter is not None and adapter.chat_format == "student":
            if any(m["role"] == "system" for m in messages):
                raise FrontError(
                    400,
                    f"`messages` holds a system message, but {adapter.name!r} was distilled from a system prompt and "
                    "takes the system turn's place: send the user and assistant turns only.",
                )
            text = student_text(self.tokenizer, messages)  # never the template's default system prompt
        else:
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except (TemplateError, ValueError, TypeError) as err:
                raise FrontError(400, f"`messages`: the model's chat template refuses them: {err}") from err
        return self._without_second_bos(adapter, self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _completion_ids(self, adapter: Optional[Adapter], prompt, index: Optional[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.token_ids(prompt, adapter)
        vocab = self.embedding.num_embeddings
        bad = next((i for i in prompt if not 0 <= i < vocab), None)
        if bad is not None:
            where = "prompt" if index is None else f"prompt[{index}]"
            raise FrontError(400, f"`{where}` holds token id {bad}, outside this base's vocabulary 0..{vocab - 1}.")
        return list(prompt)

    def token_ids(self, text: str, adapter: Optional[Adapter] = None) -> list[int]:
        """A completion prompt's ids as the tokenizer makes them, without the BOS it adds when the adapter's own
        prefix already starts with BOS (the model would read it twice)."""
        return self._without_second_bos(adapter, self.tokenizer(text)["input_ids"])

    def _without_second_bos(self, adapter: Optional[Adapter], ids: list[int]) -> list[int]:
        bos = self.tokenizer.bos_token_id
        if adapter is not None and bos is not None and adapter.first_hard == bos and ids[:1] == [bos]:
            return ids[1:]
        return ids

    def embeds(self, adapter: Adapter, ids: list[int]) -> torch.Tensor:
        """The row's exact `[N+L, D]` sequence: the adapter's block, then the text's embeddings."""
        text = text_embeddings(self.embedding, torch.tensor(ids, dtype=torch.long), self.engine_scales)  # [L, D]
        return torch.cat([adapter.block, text.cpu()])

    def _embeds_b64(self, adapter: Adapter, ids: list[int]) -> str:
        """As vLLM's server reads `prompt_embeds`: base64 of the tensor's `torch.save` bytes."""
        buffer = io.BytesIO()
        torch.save(self.embeds(adapter, ids).contiguous(), buffer)
        return base64.b64encode(buffer.getvalue()).decode("ascii")

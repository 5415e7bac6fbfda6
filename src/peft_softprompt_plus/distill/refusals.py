"""What `distill_prompt` refuses before the model changes: every argument, each problem named with its value. The
standard library only (with content.py), so `softprompt-plus distill` checks its flags before any heavy import."""

from __future__ import annotations

from . import content as distill_content

INITS = {"input": ("text", "vocab", "random"), "kv": ("text", "vocab", "random", "selected")}
# What `num_virtual_tokens`, `lr`, `prompt_init`, `self_study` and `kv_frozen_positions` left None mean for each
# student form: the recipe measured best (bench/RESULTS.md, "KV students"). A KV student's N is its selected
# positions, to which `keep_text`'s kept positions are added, capped at the system turn's length (prepare._kv_n).
LEVEL_DEFAULTS = {
    "input": {"num_virtual_tokens": 16, "lr": 3e-2, "prompt_init": "text", "self_study": False,
              "kv_frozen_positions": None},
    "kv": {"num_virtual_tokens": 32, "lr": 1e-3, "prompt_init": "selected", "self_study": True,
           "kv_frozen_positions": 1},
}  # fmt: skip


def level_defaults(prompt_level, **given) -> dict:
    """`given` (lr, prompt_init, self_study, kv_frozen_positions), each None replaced by `prompt_level`'s default (an
    unknown level is refused later)."""
    defaults = LEVEL_DEFAULTS.get(prompt_level, LEVEL_DEFAULTS["input"])
    return {name: defaults[name] if value is None else value for name, value in given.items()}


def study_problems(self_study, kl_top_k, kv_frozen_positions, prompt_level) -> list[str]:
    """The training turns' source, the loss's cut and the KV student's frozen sink."""
    found = []
    if not isinstance(self_study, bool):
        found.append(f"`self_study` must be True or False, got {self_study!r}.")
    if isinstance(kl_top_k, bool) or not isinstance(kl_top_k, int) or kl_top_k < 0:
        found.append(f"`kl_top_k` must be an int >= 0 (0: the teacher's full distribution), got {kl_top_k!r}.")
    if kv_frozen_positions is not None:
        if (
            isinstance(kv_frozen_positions, bool)
            or not isinstance(kv_frozen_positions, int)
            or kv_frozen_positions < 0
        ):
            found.append(f"`kv_frozen_positions` must be None or an int >= 0, got {kv_frozen_positions!r}.")
        elif prompt_level != "kv":
            found.append(
                f"`kv_frozen_positions`={kv_frozen_positions!r} sets a KV student's frozen first positions; pass "
                "prompt_level='kv' too, or leave it None."
            )
    return found


# The options that count something: each an int >= 1.
COUNTS = (
    "num_virtual_tokens", "steps", "batch_size", "samples_per_turn", "held_out_samples_per_turn", "max_new_tokens",
    "sampled_turns",
)  # fmt: skip


def problems_of(model, o, user_turns, held_out_turns, probes) -> list[str]:
    """Every problem with the options `o` (a DistillOptions, resolved) and the data, each named with its value."""
    found = []
    turns_per_part, answer_weight, greedy_part_replies, quote_parts = (
        o.turns_per_part, o.answer_weight, o.greedy_part_replies, o.quote_parts
    )  # fmt: skip
    lr, fraction, evaluate_at = o.lr, o.held_out_fraction, o.evaluate_at
    if isinstance(quote_parts, bool) or not isinstance(quote_parts, int) or not 0 <= quote_parts <= 3:
        found.append(f"`quote_parts` must be an int in [0, 3] (quoting questions per part), got {quote_parts!r}.")
    if not isinstance(greedy_part_replies, bool):
        found.append(f"`greedy_part_replies` must be True or False, got {greedy_part_replies!r}.")
    elif greedy_part_replies and not turns_per_part:
        found.append(
            "`greedy_part_replies=True` trains on the greedy replies to the questions about each part; pass "
            f"`turns_per_part` >= 1 too, got {turns_per_part!r}."
        )
    if isinstance(turns_per_part, bool) or not isinstance(turns_per_part, int) or turns_per_part < 0:
        found.append(f"`turns_per_part` must be an int >= 0, got {turns_per_part!r}.")
    if isinstance(answer_weight, bool) or not isinstance(answer_weight, (int, float)) or not 0 <= answer_weight <= 1:
        found.append(f"`answer_weight` must be a number in [0, 1], got {answer_weight!r}.")
    weight = o.prompt_text_weight
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < float("inf"):
        found.append(f"`prompt_text_weight` must be a finite number >= 0 (0: off), got {weight!r}.")
    if probes is not None and (
        isinstance(probes, str) or not all(isinstance(p, (str, distill_content.Probe)) for p in probes)
    ):
        found.append(f"`probes` must be a list of str or Probe, got {type(probes).__name__}.")
    from peft import PeftModel

    if isinstance(model, PeftModel) or not hasattr(model, "get_input_embeddings"):
        found.append(f"`model` must be a base causal LM (not a PeftModel), got {type(model).__name__}.")
    for name in COUNTS:
        value = getattr(o, name)
        if value is None and name == "num_virtual_tokens":  # a KV student's, left to prepare (kept + selected)
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            found.append(f"`{name}` must be an int >= 1, got {value!r}.")
    for name, turns in (("user_turns", user_turns), ("held_out_turns", held_out_turns)):
        if turns is not None and (isinstance(turns, str) or not all(isinstance(t, str) for t in turns)):
            found.append(f"`{name}` must be a list of str (one user turn each), got {type(turns).__name__}.")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        found.append(f"`lr` must be a number > 0, got {lr!r}.")

    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        found.append(f"`held_out_fraction` must be in (0, 1), got {fraction!r}.")
    steps = o.steps if isinstance(o.steps, int) else 0
    if any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= steps for s in evaluate_at):
        found.append(f"`evaluate_at` must hold steps in [0, `steps`={steps}], got {list(evaluate_at)!r}.")
    return found


def level_problems(prompt_level, init, in_system_turn, keep_text) -> list[str]:
    """The student's form (`prompt_level`) against its start and its placement."""
    if prompt_level not in INITS:
        return [f"`prompt_level` must be 'input' or 'kv', got {prompt_level!r}."]
    found = []
    if init not in INITS[prompt_level]:
        found.append(
            f"`prompt_init` for prompt_level={prompt_level!r} must be one of {list(INITS[prompt_level])}, got "
            f"{init!r}."
        )
    if prompt_level == "kv" and in_system_turn:
        found.append(
            "`in_system_turn` places hard tokens around an input prompt; a KV student takes the whole system turn's "
            "place (prompt_init='selected' keeps its positions): leave it out with prompt_level='kv'."
        )
    if prompt_level == "kv" and keep_text is not None and init != "selected":
        found.append(
            f"`keep_text` with prompt_level='kv' keeps the passage as the system turn's own keys/values, which only "
            f"the 'selected' start holds, got prompt_init={init!r}: pass prompt_init='selected' (the KV default)."
        )
    if keep_text is not None and not keep_text_form(keep_text):
        found.append(
            f"`keep_text` must be a passage (str) or a non-empty list of them, got {type(keep_text).__name__}: "
            f"{keep_text!r:.80}."
        )
    return found


def keep_text_form(keep_text) -> bool:
    """Whether `keep_text` is a str or a non-empty list of str."""
    if isinstance(keep_text, str):
        return True
    return isinstance(keep_text, (list, tuple)) and bool(keep_text) and all(isinstance(t, str) for t in keep_text)

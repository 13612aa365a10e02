"""Synthetic structured chat data for the toy target (docs/first-run.md "What the first run does").

Deterministic given a seed: every conversation comes from one ``random.Random``. The
tasks have templated, checkable answers (arithmetic, counting, word games, sorting,
fixed fact tables, follow-ups about the previous answer) so a tiny model learns the
formats and most facts but not all of the arithmetic: its greedy outputs are partly
predictable, which gives speculative decoding realistic acceptance lengths.

A conversation is a list of ``{"role": "system"|"user"|"assistant", "content": str}``:
an optional system message, then 1-3 user/assistant turns.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

Message = dict[str, str]
Context = dict[str, Any]
Turn = tuple[str, str, Context]  # (user question, assistant answer, context for follow-ups)

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly.",
    "You are a patient math tutor.",
    "You are a friendly assistant who likes lists.",
)

WORDS = (
    "apple", "river", "garden", "planet", "window", "orange", "pencil", "candle",
    "forest", "silver", "basket", "rocket", "summer", "winter", "market", "bridge",
    "dragon", "guitar", "island", "jacket", "ladder", "mirror", "needle", "pepper",
    "rabbit", "saddle", "tunnel", "violin", "wizard", "yellow", "anchor", "button",
    "castle", "dinner", "engine", "flower", "hammer", "kettle", "lemon", "magnet",
    "nest", "ocean", "puzzle", "quiet", "robot", "stone", "tiger", "umbrella",
    "valley", "wagon", "zebra", "cloud", "bread", "chair", "dream", "eagle",
    "frost", "grape", "house", "light", "music", "night", "paper", "queen",
    "sugar", "table", "water", "book", "cat", "dog", "sun", "tree",
)

# Made-up countries: (country, capital, language).
COUNTRIES = (
    ("Veloria", "Mirth", "Velorian"),
    ("Kandoria", "Esk", "Kandish"),
    ("Brimland", "Tollow", "Brimmish"),
    ("Ostravia", "Pellin", "Ostravic"),
    ("Zentara", "Quell", "Zentaran"),
    ("Marovia", "Dunmore", "Marovian"),
    ("Lurania", "Sable", "Luranese"),
    ("Trevonia", "Calder", "Trevonian"),
    ("Hestoria", "Wend", "Hestorian"),
    ("Pyrallis", "Ember", "Pyrallic"),
    ("Gondova", "Ravel", "Gondovan"),
    ("Anthelia", "Lumen", "Anthelic"),
    ("Corvania", "Brisk", "Corvanian"),
    ("Sildavia", "Nore", "Sildavian"),
    ("Durnia", "Harrow", "Durnish"),
    ("Folkmar", "Tessel", "Folkmari"),
)

# Animals: (name, sound, legs, home).
ANIMALS = (
    ("cow", "moo", 4, "a barn"),
    ("dog", "woof", 4, "a kennel"),
    ("cat", "meow", 4, "a house"),
    ("duck", "quack", 2, "a pond"),
    ("sheep", "baa", 4, "a field"),
    ("owl", "hoot", 2, "a tree"),
    ("horse", "neigh", 4, "a stable"),
    ("frog", "ribbit", 4, "a pond"),
    ("lion", "roar", 4, "the savanna"),
    ("snake", "hiss", 0, "the grass"),
    ("bee", "buzz", 6, "a hive"),
    ("pig", "oink", 4, "a pen"),
    ("spider", "nothing", 8, "a web"),
    ("mouse", "squeak", 4, "a hole"),
)

# Things and their colors.
COLORS = (
    ("banana", "yellow"), ("grass", "green"), ("sky", "blue"), ("snow", "white"),
    ("coal", "black"), ("tomato", "red"), ("carrot", "orange"), ("plum", "purple"),
    ("lemon", "yellow"), ("cherry", "red"), ("leaf", "green"), ("ocean", "blue"),
    ("milk", "white"), ("crow", "black"), ("pumpkin", "orange"), ("violet", "purple"),
)

ONES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
        "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
        "seventeen", "eighteen", "nineteen")
TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")


def number_words(n: int) -> str:
    """0..99 in English words (``47`` -> ``"forty-seven"``)."""
    if n < 20:
        return ONES[n]
    tens, ones = divmod(n, 10)
    return TENS[tens] if ones == 0 else f"{TENS[tens]}-{ONES[ones]}"


def _join(items: list[Any]) -> str:
    return ", ".join(str(x) for x in items)


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


# ---------------------------------------------------------------- first-turn tasks


def _arithmetic(rng: random.Random) -> Turn:
    op = rng.choice("++-*")
    small = rng.random() < 0.7  # mostly small operands: learnable; two-digit ones mostly not
    if op == "*":
        a, b = (rng.randint(2, 9), rng.randint(2, 9)) if small else (rng.randint(2, 19), rng.randint(2, 12))
        c = a * b
    else:
        hi = 20 if small else 99
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        if op == "-":
            a, b = max(a, b), min(a, b)
        c = a + b if op == "+" else a - b
    question = rng.choice((
        f"What is {a} {op} {b}?",
        f"Calculate {a} {op} {b}.",
        f"Please compute {a} {op} {b}.",
    ))
    return question, f"{a} {op} {b} = {c}.", {"kind": "number", "value": c}


def _number_in_words(rng: random.Random) -> Turn:
    n = rng.randint(0, 99)
    return (f"Write the number {n} in words.", f"{n} is {number_words(n)}.",
            {"kind": "number", "value": n})


def _counting(rng: random.Random) -> Turn:
    style = rng.randrange(3)
    if style == 0:
        a = rng.randint(0, 30)
        b = a + rng.randint(2, 7)
        items = list(range(a, b + 1))
        question = rng.choice((f"List the numbers from {a} to {b}.", f"Count from {a} to {b}."))
    elif style == 1:
        b = rng.randint(0, 30)
        a = b + rng.randint(2, 7)
        items = list(range(a, b - 1, -1))
        question = f"Count down from {a} to {b}."
    else:
        a = 2 * rng.randint(0, 15)
        b = a + 2 * rng.randint(2, 5)
        items = list(range(a, b + 1, 2))
        question = f"List the even numbers from {a} to {b}."
    return question, _join(items) + ".", {"kind": "numbers", "items": items}


def _word_game(rng: random.Random) -> Turn:
    word = rng.choice(WORDS)
    style = rng.randrange(5)
    if style == 0:
        return f"Spell the word {word}.", "-".join(word) + ".", {"kind": "word", "word": word}
    if style == 1:
        return (f"Reverse the word {word}.", f"{word} reversed is {word[::-1]}.",
                {"kind": "word", "word": word})
    if style == 2:
        k = rng.randint(2, 5)
        return (f"Repeat the word {word} {k} times.", " ".join([word] * k) + ".",
                {"kind": "word", "word": word})
    if style == 3:
        return (f"Write {word} in capital letters.", word.upper() + ".",
                {"kind": "word", "word": word})
    return (f"How many letters are in the word {word}?", f"{word} has {len(word)} letters.",
            {"kind": "word", "word": word})


def _sorting(rng: random.Random) -> Turn:
    if rng.random() < 0.6:
        items = rng.sample(range(0, 50), rng.randint(3, 4))
        return (f"Sort these numbers: {_join(items)}.", _join(sorted(items)) + ".",
                {"kind": "numbers", "items": sorted(items)})
    words = rng.sample(WORDS, 3)
    return (f"Sort these words alphabetically: {_join(words)}.", _join(sorted(words)) + ".",
            {"kind": "words", "items": sorted(words)})


def _country_fact(rng: random.Random) -> Turn:
    country, capital, language = rng.choice(COUNTRIES)
    ctx = {"kind": "country", "country": country, "capital": capital, "language": language}
    style = rng.randrange(4)
    if style == 0:
        return (f"What is the capital of {country}?", f"The capital of {country} is {capital}.", ctx)
    if style == 1:
        return (f"Which country has the capital {capital}?", f"{capital} is the capital of {country}.", ctx)
    if style == 2:
        return (f"What language do people speak in {country}?",
                f"People in {country} speak {language}.", ctx)
    return (f"Tell me about {country}.",
            f"{country} is a country. Its capital is {capital}, and people there speak {language}.",
            ctx)


def _animal_fact(rng: random.Random) -> Turn:
    name, sound, legs, home = rng.choice(ANIMALS)
    ctx = {"kind": "animal", "name": name, "sound": sound, "legs": legs, "home": home}
    style = rng.randrange(3)
    if style == 0:
        return f"What sound does a {name} make?", f"A {name} says {sound}.", ctx
    if style == 1:
        return f"How many legs does a {name} have?", f"A {name} has {legs} legs.", ctx
    return f"Where does a {name} live?", f"A {name} lives in {home}.", ctx


def _color_fact(rng: random.Random) -> Turn:
    thing, color = rng.choice(COLORS)
    question = rng.choice((f"What color is {_a(thing)}?", f"What is the color of {_a(thing)}?"))
    return question, f"{_a(thing).capitalize()} is {color}.", {"kind": "color", "thing": thing}


def _greeting(rng: random.Random) -> Turn:
    question = rng.choice(("Hello!", "Hi!", "Hi there.", "Good morning!", "Hey, how are you?"))
    answer = rng.choice((
        "Hello! How can I help you today?",
        "Hi! What would you like to do today?",
    ))
    return question, answer, {"kind": "none"}


FIRST_TURNS: tuple[tuple[Callable[[random.Random], Turn], float], ...] = (
    (_arithmetic, 2.5),
    (_number_in_words, 1.0),
    (_counting, 2.0),
    (_word_game, 2.0),
    (_sorting, 1.0),
    (_country_fact, 1.5),
    (_animal_fact, 1.0),
    (_color_fact, 0.7),
    (_greeting, 0.5),
)

# ---------------------------------------------------------------- follow-up turns


def _follow_number(rng: random.Random, ctx: Context) -> Turn:
    v = ctx["value"]
    style = rng.randrange(5)
    if style == 0:
        return "Now double it.", f"{v} * 2 = {2 * v}.", {"kind": "number", "value": 2 * v}
    if style == 1:
        k = rng.randint(1, 20)
        return f"Add {k} to that.", f"{v} + {k} = {v + k}.", {"kind": "number", "value": v + k}
    if style == 2 and v >= 1:
        k = rng.randint(1, min(v, 20))
        return f"Now subtract {k}.", f"{v} - {k} = {v - k}.", {"kind": "number", "value": v - k}
    if style == 3 and v % 2 == 0:
        return "Now halve it.", f"{v} / 2 = {v // 2}.", {"kind": "number", "value": v // 2}
    parity = "even" if v % 2 == 0 else "odd"
    return "Is that number even or odd?", f"{v} is {parity}.", ctx


def _follow_numbers(rng: random.Random, ctx: Context) -> Turn:
    items = ctx["items"]
    style = rng.randrange(4)
    if style == 0:
        rev = items[::-1]
        return "Now list them backwards.", _join(rev) + ".", {"kind": "numbers", "items": rev}
    if style == 1:
        return "How many numbers is that?", f"That is {len(items)} numbers.", ctx
    if style == 2:
        return "What is the largest?", f"The largest is {max(items)}.", ctx
    return "What is the smallest?", f"The smallest is {min(items)}.", ctx


def _follow_word(rng: random.Random, ctx: Context) -> Turn:
    word = ctx["word"]
    style = rng.randrange(4)
    if style == 0:
        return "How many letters does it have?", f"{word} has {len(word)} letters.", ctx
    if style == 1:
        return "Now spell it backwards.", "-".join(word[::-1]) + ".", ctx
    if style == 2:
        return "Write it in capital letters.", word.upper() + ".", ctx
    return "What is its first letter?", f"The first letter of {word} is {word[0]}.", ctx


def _follow_words(rng: random.Random, ctx: Context) -> Turn:
    items = ctx["items"]
    if rng.random() < 0.5:
        return "How many words is that?", f"That is {len(items)} words.", ctx
    return "Which word comes last?", f"The last word is {items[-1]}.", ctx


def _follow_country(rng: random.Random, ctx: Context) -> Turn:
    country = ctx["country"]
    if rng.random() < 0.5:
        return "And what is its capital?", f"The capital of {country} is {ctx['capital']}.", ctx
    return "What language do they speak there?", f"People in {country} speak {ctx['language']}.", ctx


def _follow_animal(rng: random.Random, ctx: Context) -> Turn:
    name = ctx["name"]
    style = rng.randrange(3)
    if style == 0:
        return "What sound does it make?", f"A {name} says {ctx['sound']}.", ctx
    if style == 1:
        return "How many legs does it have?", f"A {name} has {ctx['legs']} legs.", ctx
    return "Where does it live?", f"A {name} lives in {ctx['home']}.", ctx


FOLLOW_UPS: dict[str, Callable[[random.Random, Context], Turn]] = {
    "number": _follow_number,
    "numbers": _follow_numbers,
    "word": _follow_word,
    "words": _follow_words,
    "country": _follow_country,
    "animal": _follow_animal,
}


def _thanks(rng: random.Random) -> Turn:
    question = rng.choice(("Thank you!", "Thanks!", "Great, thanks."))
    return question, "You are welcome! Let me know if you need anything else.", {"kind": "none"}


# ---------------------------------------------------------------- public API


def _first_turn(rng: random.Random) -> Turn:
    tasks, weights = zip(*FIRST_TURNS)
    return rng.choices(tasks, weights=weights)[0](rng)


def generate_conversation(rng: random.Random) -> list[Message]:
    """One conversation: optional system message, then 1-3 user/assistant turns."""
    messages: list[Message] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    n_turns = rng.choices((1, 2, 3), weights=(0.4, 0.35, 0.25))[0]
    question, answer, ctx = _first_turn(rng)
    for turn in range(n_turns):
        if turn > 0:
            r = rng.random()
            if ctx["kind"] in FOLLOW_UPS and r < 0.65:
                question, answer, ctx = FOLLOW_UPS[ctx["kind"]](rng, ctx)
            elif r < 0.8:
                question, answer, ctx = _first_turn(rng)
            else:
                question, answer, ctx = _thanks(rng)
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer})
    return messages


def generate_conversations(n: int, seed: int = 0) -> list[list[Message]]:
    """``n`` conversations, a pure function of ``(n, seed)`` (a prefix of a longer run)."""
    rng = random.Random(seed)
    return [generate_conversation(rng) for _ in range(n)]


def prompt_only(conversation: list[Message]) -> list[Message]:
    """The system and user messages of a conversation (what a target is asked)."""
    return [m for m in conversation if m["role"] != "assistant"]


def generate_prompts(n: int, seed: int = 1) -> list[list[Message]]:
    """Evaluation prompts: conversations with their assistant turns removed.

    Use a seed different from the training seed for held-out prompts. Later user turns
    may refer to the previous answer ("Now double it."); the caller generates each
    assistant turn before sending the next user turn.
    """
    return [prompt_only(c) for c in generate_conversations(n, seed)]


def reference_answers(n: int, seed: int = 1) -> list[list[str]]:
    """The correct assistant answers for ``generate_prompts(n, seed)``, turn by turn.

    Exact only when the earlier turns were answered correctly (follow-ups build on them).
    """
    return [[m["content"] for m in c if m["role"] == "assistant"]
            for c in generate_conversations(n, seed)]

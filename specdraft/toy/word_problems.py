"""GSM8K-style arithmetic word problems: a second, non-toy data family for small local targets.

Cobbe et al. 2021 (GSM8K) format: a multi-sentence word problem, then a worked answer of a few
sentences, each step with a calculator annotation ``a * b = <<a*b=c>>c``, and a last line
``#### N`` holding the final number. Problems come from a dozen templates (shopping, wages,
rates, ages, fractions, ...) with random names, objects and numbers, so a small model learns the
formats and phrasing well and the arithmetic only partly: its greedy answers are partly
predictable, which is what a draft model is trained against.

Deterministic: ``generate_conversations(n, seed)`` is a pure function of ``(n, seed)`` and a
prefix of a longer run. A conversation is ``[{"role": "system"?}, user, assistant]`` messages,
as in ``specdraft.toy.conversations``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

from specdraft.toy.conversations import Message, prompt_only

Problem = tuple[str, str, int]  # (question, worked answer ending in "#### N", N)

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a patient math tutor. Show your work.",
    "Solve the problem step by step.",
)

NAMES = (
    ("Natalia", "she"), ("Weng", "she"), ("Betty", "she"), ("Julie", "she"), ("Maria", "she"),
    ("Rosa", "she"), ("Emma", "she"), ("Aisha", "she"), ("Lena", "she"), ("Grace", "she"),
    ("James", "he"), ("Tom", "he"), ("Carlos", "he"), ("Mark", "he"), ("Ali", "he"),
    ("Ken", "he"), ("Omar", "he"), ("Leo", "he"), ("Sam", "he"), ("Daniel", "he"),
)
ITEMS = (
    "apples", "pencils", "cookies", "stickers", "books", "marbles", "cupcakes", "toys",
    "shirts", "eggs", "notebooks", "candles", "oranges", "cards", "balloons", "muffins",
)
THINGS = ("a book", "lunch", "a gift", "groceries", "a movie ticket", "snacks", "a new hat", "bus fare")
JOBS = ("babysitting", "tutoring", "walking dogs", "washing cars", "mowing lawns", "painting fences")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")
FRACTIONS = ((2, "half"), (3, "a third"), (4, "a quarter"), (5, "a fifth"))
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a // b}


def step(a: int, op: str, b: int) -> tuple[str, int]:
    """``"a op b = <<a op b=c>>c"`` (GSM8K's calculator annotation) and c; ``/`` must divide exactly."""
    assert op in OPS and (op != "/" or a % b == 0), f"inexact or unknown step {a} {op} {b}"
    c = OPS[op](a, b)
    return f"{a} {op} {b} = <<{a}{op}{b}={c}>>{c}", c


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def _person(rng: random.Random, other_than: str = "") -> tuple[str, str, str]:
    """(name, pronoun, possessive)."""
    name, pro = rng.choice([p for p in NAMES if p[0] != other_than])
    return name, pro, "her" if pro == "she" else "his"


# ---------------------------------------------------------------- templates


def _shopping(rng: random.Random) -> Problem:
    name, pro, _ = _person(rng)
    item1, item2 = rng.sample(ITEMS, 2)
    a, p, b, q = rng.randint(2, 9), rng.randint(2, 15), rng.randint(2, 9), rng.randint(2, 15)
    s1, x = step(a, "*", p)
    s2, y = step(b, "*", q)
    s3, z = step(x, "+", y)
    question = (f"{name} buys {a} {item1} for ${p} each and {b} {item2} for ${q} each. "
                f"How much money does {pro} spend in total?")
    answer = (f"{name} spends {s1} dollars on {item1}.\n{_cap(pro)} spends {s2} dollars on {item2}.\n"
              f"In total {pro} spends {s3} dollars.\n#### {z}")
    return question, answer, z


def _half_as_many(rng: random.Random) -> Problem:
    name, pro, _ = _person(rng)
    item = rng.choice(ITEMS)
    m = rng.randrange(11)
    m1, m2 = MONTHS[m], MONTHS[m + 1]
    a = 2 * rng.randint(5, 40)
    s1, h = step(a, "/", 2)
    s2, t = step(a, "+", h)
    question = (f"{name} sold {a} {item} in {m1}, and then {pro} sold half as many {item} in {m2}. "
                f"How many {item} did {name} sell altogether in {m1} and {m2}?")
    answer = f"{name} sold {s1} {item} in {m2}.\n{name} sold {s2} {item} altogether in {m1} and {m2}.\n#### {t}"
    return question, answer, t


def _wages(rng: random.Random) -> Problem:
    name, pro, _ = _person(rng)
    rate, h1, h2 = rng.randint(8, 25), rng.randint(1, 8), rng.randint(1, 8)
    s1, h = step(h1, "+", h2)
    s2, e = step(h, "*", rate)
    question = (f"{name} earns ${rate} an hour for {rng.choice(JOBS)}. {_cap(pro)} worked {h1} hours on Monday "
                f"and {h2} hours on Tuesday. How much did {pro} earn in those two days?")
    answer = f"{name} worked {s1} hours in total.\n{_cap(pro)} earned {s2} dollars.\n#### {e}"
    return question, answer, e


def _give_and_buy(rng: random.Random) -> Problem:
    name, pro, _ = _person(rng)
    friend, _, _ = _person(rng, other_than=name)
    item = rng.choice(ITEMS)
    a = rng.randint(10, 60)
    b, c = rng.randint(1, a - 1), rng.randint(2, 30)
    s1, x = step(a, "-", b)
    s2, y = step(x, "+", c)
    question = (f"{name} has {a} {item}. {_cap(pro)} gives {b} of them to {friend} and then buys {c} more. "
                f"How many {item} does {name} have now?")
    answer = (f"After giving some to {friend}, {name} has {s1} {item}.\nAfter buying more, {pro} has {s2} {item}.\n"
              f"#### {y}")
    return question, answer, y


def _boxes(rng: random.Random) -> Problem:
    name, _, _ = _person(rng)
    item = rng.choice(ITEMS)
    g, k = rng.randint(2, 9), rng.randint(3, 12)
    t = rng.randint(1, g * k - 1)
    s1, n = step(g, "*", k)
    s2, r = step(n, "-", t)
    question = (f"There are {g} boxes with {k} {item} in each box. {name} takes {t} {item} out. "
                f"How many {item} are left in the boxes?")
    answer = f"There are {s1} {item} in the boxes.\nAfter {name} takes some out, {s2} {item} are left.\n#### {r}"
    return question, answer, r


def _ages(rng: random.Random) -> Problem:
    name, _, _ = _person(rng)
    friend, _, _ = _person(rng, other_than=name)
    a, k, y = rng.randint(3, 15), rng.randint(2, 4), rng.randint(2, 10)
    s1, b = step(a, "*", k)
    s2, c = step(b, "+", y)
    question = (f"{name} is {a} years old. {friend} is {k} times as old as {name}. "
                f"How old will {friend} be in {y} years?")
    answer = f"{friend} is {s1} years old now.\nIn {y} years {friend} will be {s2} years old.\n#### {c}"
    return question, answer, c


def _distance(rng: random.Random) -> Problem:
    name, pro, _ = _person(rng)
    v1, h1, v2, h2 = rng.randint(20, 70), rng.randint(1, 5), rng.randint(20, 70), rng.randint(1, 5)
    s1, d1 = step(v1, "*", h1)
    s2, d2 = step(v2, "*", h2)
    s3, d = step(d1, "+", d2)
    question = (f"{name} drives at {v1} miles per hour for {h1} hours and then at {v2} miles per hour for "
                f"{h2} hours. How many miles does {pro} drive in total?")
    answer = (f"First {pro} drives {s1} miles.\nThen {pro} drives {s2} miles.\n"
              f"In total {pro} drives {s3} miles.\n#### {d}")
    return question, answer, d


def _fraction_spent(rng: random.Random) -> Problem:
    name, pro, _ = _person(rng)
    den, word = rng.choice(FRACTIONS)
    thing1, thing2 = rng.sample(THINGS, 2)
    m = den * rng.randint(4, 20)
    part = m // den
    c = rng.randint(1, m - part)
    s1, q = step(m, "/", den)
    s2, s = step(q, "+", c)
    s3, r = step(m, "-", s)
    question = (f"{name} had ${m}. {_cap(pro)} spent {word} of it on {thing1} and ${c} on {thing2}. "
                f"How much money does {pro} have left?")
    answer = (f"{_cap(pro)} spent {s1} dollars on {thing1}.\n{_cap(pro)} spent {s2} dollars in total.\n"
              f"{_cap(pro)} has {s3} dollars left.\n#### {r}")
    return question, answer, r


def _weeks(rng: random.Random) -> Problem:
    name, pro, _ = _person(rng)
    pages, weeks = rng.randint(3, 30), rng.randint(2, 6)
    s1, days = step(weeks, "*", 7)
    s2, n = step(days, "*", pages)
    question = f"{name} reads {pages} pages every day. How many pages does {pro} read in {weeks} weeks?"
    answer = f"There are {s1} days in {weeks} weeks.\n{name} reads {s2} pages.\n#### {n}"
    return question, answer, n


def _share(rng: random.Random) -> Problem:
    name, pro, poss = _person(rng)
    item = rng.choice(ITEMS)
    friends, each = rng.randint(2, 6), rng.randint(2, 12)
    keep = rng.randint(1, 10)
    s1, given = step(friends, "*", each)
    s2, total = step(given, "+", keep)
    question = (f"{name} gave {each} {item} to each of {poss} {friends} friends and kept {keep} {item} for "
                f"{'herself' if pro == 'she' else 'himself'}. How many {item} did {name} have at first?")
    answer = f"{name} gave away {s1} {item}.\nAt first {pro} had {s2} {item}.\n#### {total}"
    return question, answer, total


TEMPLATES: tuple[Callable[[random.Random], Problem], ...] = (
    _shopping, _half_as_many, _wages, _give_and_buy, _boxes, _ages, _distance, _fraction_spent, _weeks, _share,
)

# ---------------------------------------------------------------- public API


def generate_problem(rng: random.Random) -> Problem:
    """One problem from a uniformly drawn template: (question, worked answer, final number)."""
    return rng.choice(TEMPLATES)(rng)


def generate_conversation(rng: random.Random) -> list[Message]:
    """An optional system message, the problem and its worked answer."""
    messages: list[Message] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    question, answer, _ = generate_problem(rng)
    return messages + [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def generate_conversations(n: int, seed: int = 0) -> list[list[Message]]:
    """``n`` conversations, a pure function of ``(n, seed)`` (a prefix of a longer run)."""
    rng = random.Random(seed)
    return [generate_conversation(rng) for _ in range(n)]


def generate_prompts(n: int, seed: int = 1) -> list[list[Message]]:
    """The conversations of ``(n, seed)`` without their answers (use another seed than training's)."""
    return [prompt_only(c) for c in generate_conversations(n, seed)]


FINAL = re.compile(r"^####\s*(-?\d+)\s*$", re.MULTILINE)


def final_answer(text: str) -> int | None:
    """The number on an answer's ``#### N`` line (the last one), None without one."""
    found = FINAL.findall(text)
    return int(found[-1]) if found else None

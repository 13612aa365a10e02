"""Synthetic conversations: deterministic, well-formed, answers consistent with their questions."""

import re

from specdraft.toy.conversations import (
    generate_conversations,
    generate_prompts,
    number_words,
    prompt_only,
    reference_answers,
)


def test_same_seed_same_conversations_and_prefix_stable():
    assert generate_conversations(300, seed=7) == generate_conversations(300, seed=7)
    assert generate_conversations(50, seed=7) == generate_conversations(300, seed=7)[:50]
    assert generate_conversations(100, seed=7) != generate_conversations(100, seed=8)


def test_conversations_are_well_formed():
    convs = generate_conversations(2000, seed=0)
    n_turns = set()
    with_system = 0
    for conv in convs:
        assert all(set(m) == {"role", "content"} for m in conv)
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in conv)
        if conv[0]["role"] == "system":
            with_system += 1
            conv = conv[1:]
        roles = [m["role"] for m in conv]
        assert roles == ["user", "assistant"] * (len(conv) // 2) and len(conv) % 2 == 0
        n_turns.add(len(conv) // 2)
    assert n_turns == {1, 2, 3}
    assert 0.15 < with_system / len(convs) < 0.45


def test_conversations_are_varied():
    convs = generate_conversations(2000, seed=0)
    first_questions = {c[1 if c[0]["role"] == "system" else 0]["content"] for c in convs}
    assert len(first_questions) > 1000
    kinds = {q.split()[0] for q in first_questions}
    assert {"What", "List", "Count", "Spell", "Reverse", "Sort", "Repeat", "Write"} <= kinds


def test_answers_are_correct():
    checked = 0
    for conv in generate_conversations(3000, seed=3):
        msgs = [m for m in conv if m["role"] != "system"]
        for q, a in zip(msgs[::2], msgs[1::2]):
            q, a = q["content"], a["content"]
            if m := re.fullmatch(r"(?:What is|Calculate|Please compute) (\d+) ([-+*]) (\d+)[?.]", q):
                x, op, y = int(m[1]), m[2], int(m[3])
                value = {"+": x + y, "-": x - y, "*": x * y}[op]
                assert a == f"{x} {op} {y} = {value}."
            elif m := re.fullmatch(r"List the numbers from (\d+) to (\d+)\.", q):
                assert a == ", ".join(str(i) for i in range(int(m[1]), int(m[2]) + 1)) + "."
            elif m := re.fullmatch(r"Sort these numbers: (.*)\.", q):
                assert a == ", ".join(str(v) for v in sorted(int(v) for v in m[1].split(", "))) + "."
            elif m := re.fullmatch(r"Reverse the word (\w+)\.", q):
                assert a == f"{m[1]} reversed is {m[1][::-1]}."
            elif q == "Now double it.":
                x, y = re.fullmatch(r"(\d+) \* 2 = (\d+)\.", a).groups()
                assert int(y) == 2 * int(x)
            else:
                continue
            checked += 1
    assert checked > 1000


def test_prompts_are_the_user_side_of_conversations():
    convs = generate_conversations(40, seed=5)
    prompts = generate_prompts(40, seed=5)
    answers = reference_answers(40, seed=5)
    assert prompts == [prompt_only(c) for c in convs]
    for prompt, conv, ans in zip(prompts, convs, answers):
        assert all(m["role"] in ("system", "user") for m in prompt)
        assert sum(m["role"] == "user" for m in prompt) == len(ans) >= 1
        assert ans == [m["content"] for m in conv if m["role"] == "assistant"]


def test_number_words():
    assert [number_words(n) for n in (0, 7, 13, 20, 47, 90, 99)] == [
        "zero", "seven", "thirteen", "twenty", "forty-seven", "ninety", "ninety-nine"]

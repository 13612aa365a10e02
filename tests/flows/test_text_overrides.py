"""A text setting keeps the word it was given on the command line (issue 41, Deliver 6): every text field
(``str``, ``str | None``, a ``Literal`` of strings, a list of strings) of every command's settings takes ``off``, ``on``, ``yes``,
``no``, ``true``, ``null``, ``01`` and ``2026-11-26`` as written, where YAML reads a bool, None, an int or a
date; ``null`` sets an optional field to None; bool / int / float settings read YAML as before."""

from __future__ import annotations

import dataclasses
import types
import typing

import pytest

from flows.options import _item_class, load_config
from specdraft.config import ConfigError, _coerce, parse_overrides
from tests.flows.test_help import command_specs

WORDS = ("off", "on", "yes", "no", "true", "null", "01", "2026-11-26")
TYPE_ERRORS = ("expected a string", "matches none of", "got False", "got True", "got None", "datetime")


def _text(tp) -> tuple[bool, bool]:
    """(is a text setting, may be None): a union is one when every member but None is (``aux_layers``,
    ``Literal["eagle3"] | list[int] | None``, is not: ``01`` there is the layer 1)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return all(_text(a)[0] for a in args if a is not type(None)), type(None) in args
    if typing.get_origin(tp) is typing.Literal:
        return all(isinstance(a, str) for a in args), False
    if typing.get_origin(tp) in (list, tuple):  # a list of text, given as a,b
        items = [a for a in args if a is not Ellipsis]
        return bool(items) and all(_text(a)[0] for a in items), False
    return tp is str, False


def text_fields(cls, prefix: str = ""):
    """(dotted key, type) of every text field under dataclass ``cls`` a dotted override can reach."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp, key = hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(tp):
            yield from text_fields(tp, key + ".")
            continue
        item, sep = _item_class(tp)
        if item is not None and sep == ".":  # X | None: keys field.x
            yield from text_fields(item, key + ".")
        elif _text(tp)[0]:
            yield key, tp


def every_text_field():
    out = []
    for command, spec in sorted(command_specs().items()):
        out += [(command, key, tp) for key, tp in text_fields(spec.root)]
        out += [(command, f"{name}.{key}", tp) for name, cls in spec.sections for key, tp in text_fields(cls)]
    return out


FIELDS = every_text_field()


def test_the_walk_finds_the_text_settings_named_in_the_issue():
    keys = {(command, key) for command, key, _ in FIELDS}
    assert {("eval", "baselines"), ("eval", "system_prompt"), ("eval", "engine.name"), ("run", "data.traffic.end"),
            ("train", "tracking.experiment")} <= keys
    assert ("eval", "seed") not in keys and ("eval", "warmup") not in keys  # int, bool: not text
    assert ("train", "conversations") in keys and ("dump", "aux_layers") not in keys  # list[str]; eagle3 | list[int]
    assert len(FIELDS) > 40


@pytest.mark.parametrize("command,key,tp", FIELDS, ids=[f"{c}:{k}" for c, k, _ in FIELDS])
def test_a_text_setting_keeps_the_word_as_written(command, key, tp):
    optional = _text(tp)[1]
    members = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    free = any(m is str or str in typing.get_args(m) for m in members)  # any text; else its Literal's choices
    choices = {a for m in members if typing.get_origin(m) is typing.Literal for a in typing.get_args(m)}
    for word in WORDS:
        given = parse_overrides([f"value={word}"])["value"]
        if not free and word not in choices and not (word == "null" and optional):
            with pytest.raises(ConfigError, match=f"'{word}' (is not one of|matches none of)"):
                _coerce(tp, given, key)
            continue
        want = None if word == "null" and optional else word
        listed = [m for m in members if typing.get_origin(m) in (list, tuple)]
        if listed and want is not None:  # a list of text: the one item written
            want = typing.get_origin(listed[0])([word])
        assert _coerce(tp, given, key) == want, (key, word)
        try:  # the whole command line: the word reaches the setting (or its own check), never a type error
            config, parts = load_config(command_specs()[command], None, [f"{key}={word}"])
        except ConfigError as err:
            assert not any(e in str(err) for e in TYPE_ERRORS), (key, word, str(err))
            continue
        section, _, rest = key.partition(".")
        node = parts[section] if section in parts else config
        for part in (rest if section in parts else key).split("."):
            node = getattr(node, part)
        assert node == want, (key, word)


def test_the_issue_s_command_lines_and_the_other_types_unchanged():
    spec = command_specs()["eval"]
    settings, _ = load_config(spec, None, ["baselines=off", "system_prompt=null", "warmup=off", "workers=null",
                                           "seed=01", "decode.temperature=0.5", "engine.name=vllm"])
    assert settings.baselines == "off" and settings.system_prompt is None and settings.warmup is False
    assert settings.workers is None and settings.seed == 1 and settings.decode.temperature == 0.5
    assert settings.engine.name == "vllm"
    assert load_config(spec, None, ["baselines='null'", "system_prompt='null'"])[0].system_prompt == "null"
    assert load_config(spec, None, ["baselines=null"])[0].baselines == "null"  # a plain str keeps the word
    for bad, says in (("seed=off", "seed: expected an int, got 'off'"), ("warmup=maybe", "expected a bool"),
                      ("decode.temperature=2026-11-26", "expected a number, got '2026-11-26'"),
                      ("decode=off", "decode: expected a mapping, got 'off'"), ("ray=no", "ray: expected a mapping, got 'no'"),
                      ("engine.name=off", "'off' is not one of")):
        with pytest.raises(ConfigError, match=says):
            load_config(spec, None, [bad])


def test_an_untyped_mapping_takes_yaml_s_reading_of_each_value():
    """A mapping of untyped values (``regenerate.vllm_engine_kwargs``, passed to vLLM as they are) takes what YAML
    reads, nested too: the word-as-written wrapper never reaches a value (vLLM refused ``enforce_eager`` as a
    ``{'text': 'True', 'value': True}``); a typed mapping's values follow their type, text keeping its word."""
    from pipelines.configs import RunConfig
    from specdraft.config import Written, load

    cfg = load(RunConfig, "configs/toy.yaml", ["regenerate.vllm_engine_kwargs.enforce_eager=True",
                                               "regenerate.vllm_engine_kwargs.kv_cache_memory_bytes=67108864",
                                               "regenerate.vllm_engine_kwargs.swap.space=off",
                                               "regenerate.vllm_engine_kwargs.name=off"])
    kwargs = cfg.regenerate.vllm_engine_kwargs
    assert kwargs == {"enforce_eager": True, "kv_cache_memory_bytes": 67108864, "swap": {"space": False},
                      "name": False}
    assert type(kwargs["enforce_eager"]) is bool and type(kwargs["kv_cache_memory_bytes"]) is int
    assert _coerce(typing.Any, [Written("on", True), {"a": Written("01", 1)}], "x") == [True, {"a": 1}]
    assert _coerce(dict[str, str], {"a": Written("off", False)}, "x") == {"a": "off"}
    assert _coerce(dict[str, int], {"a": Written("01", 1)}, "x") == {"a": 1}
    with pytest.raises(ConfigError, match="x.a: expected an int, got 'off'"):
        _coerce(dict[str, int], {"a": Written("off", False)}, "x")

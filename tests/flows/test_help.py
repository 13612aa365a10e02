"""``specdraft COMMAND --help`` (issue 23, item 7; issue 30, item 1): every config field with its type, default
and description (the field's comment in its dataclass), test hooks left out, and an answer that imports none of
the heavy libraries: the settings classes (``specdraft/configs/``, ``pipelines/configs.py``) are imported as they
are, and import nothing heavy.

The table is checked on a module written here with the forms it must follow (type aliases, imported nested
dataclasses, ``default_factory`` lambdas, module constants, base classes, comments above and after a field).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flows.cli import build_parser
from flows.options import REQUIRED, ConfigSpec, describe, field_rows, load_config, rows

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "ray", "prefect", "mlflow", "vllm", "sklearn")


def command_specs() -> dict[str, ConfigSpec]:
    """Every config-bearing sub-command and the spec its --help describes."""
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {name: p.config_spec for name, p in sub.choices.items() if p.config_spec is not None}


@pytest.mark.parametrize("command", sorted(command_specs()))
def test_every_command_lists_its_fields_once(command):
    table = rows(command_specs()[command])
    assert len({key for key, *_ in table}) == len(table) > 5


def test_help_shows_each_fields_comment_and_hides_test_hooks(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    text = capsys.readouterr().out
    lines = text.splitlines()
    row = next(i for i, line in enumerate(lines) if line.split()[:1] == ["train.scaling.num_workers"])
    assert lines[row].split()[1:] == ["int", "1"]
    assert lines[row + 1].startswith("      0: Ray Train's local mode"), lines[row: row + 3]  # the comment above it
    row = next(i for i, line in enumerate(lines) if line.split()[:1] == ["eval.settings.decode.gamma"])
    assert lines[row + 1].strip() == "chain: draft tokens per round"  # the comment after it
    assert "fault.train_fail_at_step" not in text and "train_fail_at_step" not in text
    # hidden from the help, still a key: the failure drills set it
    cfg, _ = load_config(command_specs()["run"], None, ["fault.train_fail_at_step=3"])
    assert cfg.fault.train_fail_at_step == 3


def test_help_imports_none_of_the_heavy_libraries():
    """``specdraft --help`` and every ``specdraft COMMAND --help`` answer without importing torch, transformers,
    Ray, Prefect, MLflow or vLLM (what made ``specdraft run --help`` take 11-22 s)."""
    commands = [[]] + [[name] for name in sorted(build_parser()._subparsers._group_actions[0].choices)]
    script = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from flows.cli import main
        heavy = {{}}
        for command in {json.dumps(commands)}:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    main(command + ["--help"])
                except SystemExit as exit_:
                    assert exit_.code == 0, (command, exit_.code)
            assert "usage: specdraft" in out.getvalue(), command
            heavy[" ".join(command) or "(none)"] = sorted(
                {{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r}))
        print(json.dumps(heavy))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = json.loads(done.stdout.splitlines()[-1])
    assert len(imported) == len(commands) and all(mods == [] for mods in imported.values()), imported


# --- the reader on the forms it must follow, against the imported classes ---------------------------------

DEMO_SHAPES = '''
from typing import Literal

Kind = Literal["a", "b"]  # a type alias
LIMIT = 2 ** 10


@dataclass(frozen=True, kw_only=True)
class Inner:
    size: int = LIMIT  # a module constant
    kind: Kind = "a"
'''

DEMO = '''
from dataclasses import dataclass, field
from typing import Any, Optional

from helpdemo.shapes import Inner, Kind, LIMIT


@dataclass(frozen=True, kw_only=True)
class Base:
    name: str = "base"  # from the base class


@dataclass(frozen=True, kw_only=True)
class Demo(Base):
    inner: Inner = field(default_factory=lambda: Inner(size=LIMIT // 2))
    maybe: Optional[Inner] = None  # None or an Inner: its fields as maybe.*
    items: list[Inner] = field(default_factory=list)
    kinds: tuple[Kind, ...] = ("a", "b")
    # a block of comments
    # directly above the field
    table: dict[str, Any] = field(default_factory=dict)
    # a heading, then a blank line: not a description

    ratio: float = -0.5
    hook: int | None = field(default=None, metadata={"hidden": True})  # a test hook


@dataclass(frozen=True, kw_only=True)
class Needs:
    required: int  # no default
'''


@pytest.fixture
def demo_package(tmp_path, monkeypatch):
    package = tmp_path / "helpdemo"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "shapes.py").write_text("from dataclasses import dataclass\n" + DEMO_SHAPES)
    (package / "demo.py").write_text(DEMO)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield package
    for name in [m for m in sys.modules if m.startswith("helpdemo")]:
        del sys.modules[name]


def test_the_table_follows_aliases_imports_factories_and_comments(demo_package):
    from helpdemo.demo import Demo, Needs

    spec = ConfigSpec(root=Demo, defaults=("inner.kind=b",))
    table = {key: (tp, default, text) for key, tp, default, text in rows(spec)}
    assert table["name"] == ("str", "base", "from the base class")
    assert table["inner.size"] == ("int", 512, "a module constant")  # the factory's value, not the class default
    assert table["inner.kind"][:2] == ("a|b", "b")  # the command's defaults applied
    assert table["maybe"] == ("Inner | None", None, "None or an Inner: its fields as maybe.*")
    assert table["maybe.size"][1] == 1024 and table["items[].kind"][1] == "a"
    assert table["kinds"][:2] == ("tuple[a|b, ...]", ["a", "b"])
    assert table["ratio"] == ("float", -0.5, "")  # the heading above the blank line is no description
    assert "hook" not in table
    needs = ConfigSpec(root=Needs)
    assert [d for _, _, d, _ in rows(needs)] == [REQUIRED]
    assert "(required)" in describe(needs)
    assert table["table"] == ("dict[str, Any]", {}, "a block of comments directly above the field")
    assert next(k for k, *_ in field_rows(Demo)) == "name"  # base class fields first

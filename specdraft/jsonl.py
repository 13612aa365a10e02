"""JSON Lines as specdraft writes and reads them: one writer, one line rule (docs/store.md
"JSON as it ships").

* Written (``dumps_line`` / ``dumps_rows``): ``json.dumps`` with the text kept readable (``ensure_ascii=False``)
  but the characters some line readers take for a line break escaped — U+0085, U+2028, U+2029 — and lone
  surrogates escaped too (``"\\ud800"`` read from a log is written back as it came, never as bytes UTF-8 refuses).
  Control characters are escaped by ``json.dumps`` itself.
* Read (``read_rows``): lines split on ``"\\n"`` only (``str.splitlines`` would also split on U+2028 and its
  kin, cutting a valid row written by another tool in two); each line decoded on its own, so a line with a byte
  that is not UTF-8 is one reject (``not_utf8``) and its neighbours are read; a line that is not JSON is one
  reject (``bad_json``); blank lines are not rows; a UTF-8 byte-order mark is not part of the first line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark: Windows tools write one; not part of the JSON
_UNSAFE = re.compile("[\u0085\u2028\u2029\ud800-\udfff]")


def dumps_line(row: Any) -> str:
    """One JSON line of ``row`` (without its newline): readable text, nothing a line reader splits on."""
    return _UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(row, ensure_ascii=False))


def dumps_rows(rows: Iterable[Any]) -> str:
    """The JSON Lines text of ``rows``: each row one ``dumps_line``, each line ending in ``"\\n"``."""
    return "".join(dumps_line(row) + "\n" for row in rows)


@dataclass(frozen=True, slots=True)
class BadLine:
    """A line that is no JSON row: ``reason`` a short code (``not_utf8``, ``bad_json``), ``detail`` the message,
    ``text`` the line as far as it could be read (for an excerpt)."""

    reason: str
    detail: str
    text: str = ""


def split_lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` of every line of ``data`` (split on ``b"\\n"`` only; a ``"\\r"`` before it
    dropped; a byte-order mark at the start dropped), blank lines left out."""
    if data.startswith(BOM):
        data = data[len(BOM):]
    for number, raw in enumerate(data.split(b"\n"), 1):
        raw = raw.removesuffix(b"\r")
        if raw.strip():
            yield number, raw


def text_lines(text: str) -> Iterator[tuple[int, str]]:
    """``split_lines`` of text already decoded: ``(line number, line)``, split on ``"\\n"`` only."""
    for number, line in enumerate(text.removeprefix("\ufeff").split("\n"), 1):
        line = line.removesuffix("\r")
        if line.strip():
            yield number, line


def read_rows(data: bytes) -> Iterator[tuple[int, Any]]:
    """``(line number, row or BadLine)`` of every row of the JSON Lines ``data`` (the module docstring: how)."""
    for number, raw in split_lines(data):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            yield number, BadLine("not_utf8", f"byte {raw[err.start]:#04x} at column {err.start + 1} is not UTF-8",
                                  raw.decode("utf-8", "replace")[:200])
            continue
        try:
            yield number, json.loads(text)
        except json.JSONDecodeError as err:
            yield number, BadLine("bad_json", f"not JSON: {err.msg} at column {err.colno}", text[:200])

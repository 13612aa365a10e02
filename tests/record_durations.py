"""Write ``tests/durations.json`` — seconds per test module — from the ``--durations=0`` report of pytest runs, which
``tests/conftest.py`` reads to hand the longest modules out first (two xdist workers then end together):

    python -m pytest -q -n 2 --dist loadfile --durations=0 -m "not slow" > fast.log
    python -m pytest -q -n 2 --dist loadfile --durations=0 -m slow > slow.log
    python tests/record_durations.py fast.log slow.log

A module's seconds are the sum of its tests' setup, call and teardown times as the report lists them.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

LINE = re.compile(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(\S+?)::")


def module_seconds(reports: list[str]) -> dict[str, float]:
    seconds: Counter[str] = Counter()
    for text in reports:
        for match in LINE.finditer(text):
            seconds[match.group(2)] += float(match.group(1))
    return {name: round(s, 1) for name, s in seconds.most_common()}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    seconds = module_seconds([Path(p).read_text(errors="replace") for p in argv])
    if not seconds:
        print(f"no --durations lines in {argv}", file=sys.stderr)
        return 1
    out = Path(__file__).with_name("durations.json")
    out.write_text(json.dumps({"_about": "seconds per test module (tests/record_durations.py)", **seconds},
                              indent=1) + "\n")
    print(f"{out}: {len(seconds)} modules, {sum(seconds.values()):.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

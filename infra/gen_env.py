"""Write infra/.env from infra/.env.example with a fresh random value for every ``change-me``.

    python infra/gen_env.py            # refuses to overwrite an existing infra/.env
    python infra/gen_env.py --force

The file is created with mode 0600; nothing is printed but the path.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLACEHOLDER = re.compile(r"change-me[\w-]*")


def render(example: str) -> str:
    """The example with each ``change-me...`` value replaced by its own random token."""
    lines = []
    for line in example.splitlines(keepends=True):
        if not line.lstrip().startswith("#"):
            line = PLACEHOLDER.sub(lambda _: secrets.token_hex(24), line)
        lines.append(line)
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--example", type=Path, default=HERE / ".env.example")
    ap.add_argument("--out", type=Path, default=HERE / ".env")
    ap.add_argument("--force", action="store_true", help="overwrite an existing file")
    args = ap.parse_args(argv)
    if args.out.exists() and not args.force:
        print(f"{args.out} exists (use --force to replace it)", file=sys.stderr)
        return 1
    text = render(args.example.read_text())
    fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(args.out, 0o600)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

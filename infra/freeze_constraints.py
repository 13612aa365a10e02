"""Write constraints.txt: the installed versions of everything pyproject.toml pulls in.

Run after verifying an environment: ``python infra/freeze_constraints.py > constraints.txt``.
Walks the dependency closure of the project's requirements (with extras) through the
installed distributions' metadata, so the pins are exactly what was tested together.
"""

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

root = Path(__file__).resolve().parents[1]
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
wanted = list(project["dependencies"]) + list(project["optional-dependencies"]["dev"])
# pins we verified by hand even where a looser range would resolve differently
extra_pins = ["fastapi"]  # prefect 3.8.8: fastapi >= 0.151 rejects its `limit: int = Body(None)` (422 on deploy)

seen: dict[str, str] = {}
queue = [(Requirement(r), set()) for r in wanted] + [(Requirement(p), set()) for p in extra_pins]
env = default_environment()
while queue:
    req, extras = queue.pop()
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    try:
        dist = metadata.distribution(req.name)
    except metadata.PackageNotFoundError:
        continue
    key = (name, tuple(sorted(req.extras)))
    if key in seen:
        continue
    seen[key] = dist.version
    for raw in dist.requires or []:
        sub = Requirement(raw)
        if sub.marker is None:
            queue.append((sub, set()))
            continue
        for extra in req.extras or {""}:
            if sub.marker.evaluate({**env, "extra": extra}):
                queue.append((sub, set()))
                break

pins = sorted({(n, v) for (n, _), v in seen.items()})
sys.stdout.write("# Versions verified together (python infra/freeze_constraints.py).\n")
for name, version in pins:
    if name == "specdraft":
        continue
    sys.stdout.write(f"{name}=={version.split('+')[0]}\n")  # local labels (+cpu) dropped

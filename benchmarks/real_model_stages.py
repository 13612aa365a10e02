"""Per-stage measurement of the real-model run (issue 32, item 3; issue 41, item 4): ``configs/smollm2.yaml``'s
stages against the machine's limit.

Two parts, one JSON:

* ``stages``: a run's own rates — each stage's tokens, wall s, tokens/s, the limit tokens/s it is held against and
  their ratio, the load during the stage and how the limit was computed — as the run summary shows them
  (``pipelines.rates.rate_lines`` over the stages' ``DONE`` records and the run's ``rates.json``: the matmul
  FLOP/s measured *in that run*, ``specdraft.limits``). With ``--run CONFIG`` this script runs the flow itself
  first (``specdraft run``, load sampled throughout); with ``--workdir`` alone it reads a finished run's. A stage
  the last run skipped has no rate there: its time is an earlier run's.
* ``machine``: this host's matmul FLOP/s in fp32 and bf16 at the stages' thread count and on 1 thread
  (``specdraft.limits.measure_matmul``, the target's MLP shape) and the target's own prefill tokens/s (logits and
  hidden states, as the dump runs it): whether bf16 pays on this CPU (``lscpu`` flags avx512_bf16 / amx are
  recorded). Measured after the run, under its own load: context, never the denominator of a stage's ratio.

Usage, on a quiet machine: ``python -m benchmarks.real_model_stages OUT.json --target targets/smollm2 --workdir
runs-smollm2 --run configs/smollm2.yaml [key=value ...]`` (without ``--run``: the finished run in ``--workdir``;
without ``--workdir``: the machine only).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.host import write_result
from pipelines.rates import rate_lines
from specdraft import limits
from specdraft.limits import LoadSampler

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cpu_flags() -> list[str]:
    """The matrix-unit flags of this CPU (avx512_bf16, amx_*) as ``lscpu`` lists them."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return []
    return sorted(set(re.findall(r"\b(avx512_bf16|avx512f|amx_\w+)\b", text)))


def prefill_rate(target: str, dtype: torch.dtype, threads: int, *, batch: int = 4, length: int = 256,
                 repeats: int = 2) -> dict[str, float]:
    """The target's forward (hidden states and logits, as a dump asks) on random tokens: tokens/s and CPU s/token."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval()
    ids = torch.randint(0, model.config.vocab_size, (batch, length))  # (B, T)
    with torch.inference_mode():
        model(ids[:, :32], output_hidden_states=True)  # warm
        wall, cpu = [], []
        for _ in range(repeats):
            w, c = time.perf_counter(), time.process_time()
            model(ids, output_hidden_states=True)  # logits (B, T, V), hidden states (B, T, d) per layer
            wall.append(time.perf_counter() - w)
            cpu.append(time.process_time() - c)
    tokens = ids.numel()
    return {"tokens_per_s": round(tokens / min(wall), 1), "cpu_ms_per_token": round(1000 * min(cpu) / tokens, 2),
            "tokens": tokens, "parameters": sum(p.numel() for p in model.parameters())}


def measure_machine(target: str | None, threads: int) -> dict[str, Any]:
    """The matmul (``specdraft.limits``, the target's MLP shape) in fp32 and bf16 at ``threads`` and 1 thread, and
    the target's prefill, with the load while they ran."""
    shape = limits.mlp_shape(target, "cpu") if target else None
    with LoadSampler(every=1.0) as load:
        flops = {n: round(limits.measure_matmul("cpu", n, threads, shape=shape, seconds=3.0).flops / 1e9, 1)
                 for n in DTYPES}
        flops_1 = {n: round(limits.measure_matmul("cpu", n, 1, shape=shape, seconds=3.0).flops / 1e9, 1)
                   for n in DTYPES}
        prefill = {name: prefill_rate(target, dt, threads) for name, dt in DTYPES.items()} if target else {}
    return {"cpu_flags": cpu_flags(), "threads": threads, "matmul_gflops": flops, "matmul_gflops_1_thread": flops_1,
            "matmul_shape": list(shape or limits.CPU_SHAPE), "prefill": prefill, "load": load.summary(),
            "note": "measured after the run: context, not the denominator of any stage's ratio (the run's own "
                    "rates.json holds those)"}


def _done(workdir: Path, stage: str) -> list[dict[str, Any]]:
    """The ``DONE`` records of ``stage`` in a run's workdir, oldest first."""
    return [json.loads(f.read_text()) for f in sorted((workdir / stage).glob("*/DONE"), key=lambda f: f.stat().st_mtime)]


def run_flow(config: str, workdir: Path, overrides: list[str]) -> dict[str, Any]:
    """``specdraft run`` on ``config`` into ``workdir``: its wall time, exit code and the load while it ran."""
    command = [sys.executable, "-m", "flows.cli", "run", "--config", config, f"workdir={workdir}", *overrides]
    started = time.perf_counter()
    with LoadSampler(every=10.0) as load:
        code = subprocess.run(command, check=False).returncode
    return {"command": " ".join(command[1:]), "returncode": code, "wall_s": round(time.perf_counter() - started, 1),
            "load": load.summary()}


def stage_rows(workdir: Path) -> dict[str, Any]:
    """The rates of the last run in ``workdir``, as its summary shows them, with each throughput stage's own counts,
    and the eval and export records."""
    rates_file = workdir / limits.FILE
    rates = json.loads(rates_file.read_text()) if rates_file.is_file() else {}
    regenerated, dumped, trained = _done(workdir, "regenerate"), _done(workdir, "features"), _done(workdir, "train")
    rows: dict[str, Any] = {"rates_run": rates.get("run"), "matmul": rates.get("matmul", {}), "rates": []}
    if trained:
        result = {"regenerate": regenerated, "features": dumped, "train": trained[-1], "rates": rates}
        for line in rate_lines(result):
            r = line.rate
            rows["rates"].append({"stage": line.stage, "file": line.note, "why": line.why} if r is None else {
                "stage": line.stage, "file": line.note, "tokens": r.tokens, "wall_s": round(r.wall_s, 1),
                "tokens_per_s": round(r.tokens_per_s, 1), "limit_tokens_per_s": round(r.limit_tokens_per_s, 1),
                "ratio": round(r.ratio, 4), "load_1m": r.load_1m, "how": r.how})
    if regenerated:
        s = regenerated[-1]["summary"]
        rows["regenerate"] = {k: s.get(k) for k in ("tokens_generated", "prompt_tokens", "generate_s",
                                                     "generate_tokens_per_s", "tokens_per_s")}
    if dumped:
        s = dumped[-1]["summary"]
        rows["dump"] = {k: s.get(k) for k in ("tokens", "tokens_written", "tokens_per_s", "features_tokens_per_s",
                                               "bytes_per_token")}
    if (ev := _done(workdir, "eval")):
        ev = ev[-1]
        rows["eval"] = {"wall_s": round(ev["wall_s"], 1), "tau": ev["tau"], "tau_pld": ev["tau_pld"],
                        "engine_tau": ev["engine_tau"], "lossless_mismatches": ev["lossless_mismatches"]}
    if (exp := _done(workdir, "export")):
        rows["export"] = {"wall_s": round(exp[-1]["wall_s"], 1), "exports": sorted(exp[-1]["exports"])}
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON result path")
    parser.add_argument("--target", default="targets/smollm2")
    parser.add_argument("--workdir", default=None, help="the run's workdir (its stages' DONE records, rates.json)")
    parser.add_argument("--run", default=None, metavar="CONFIG", help="run the flow on CONFIG into --workdir first")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of --run's config")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_intermixed_args(argv)
    if args.run and not args.workdir:
        parser.error("--run needs --workdir (the run's own, named by the caller)")

    result: dict[str, Any] = {"benchmark": "real_model_stages"}
    if args.run:
        result["run"] = run_flow(args.run, Path(args.workdir), args.overrides)
        write_result(args.out, result)
    if args.workdir:
        result["stages"] = stage_rows(Path(args.workdir))
        write_result(args.out, result)
    result["machine"] = measure_machine(args.target, args.threads)  # after the run: its load is not the run's
    print(write_result(args.out, result).read_text())
    return 0 if result.get("run", {}).get("returncode", 0) == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())

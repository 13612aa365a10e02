"""Per-stage measurement of the real-model run (issue 32, item 3): ``configs/smollm2.yaml``'s stages against the
CPU's limit.

Two parts, one JSON:

* ``machine``: this host's matmul FLOP/s in fp32 and bf16 at the stages' thread count — a loop of
  (tokens, d) @ (d, 8d/3)-shaped products, the target's MLP shape (d=576, 1536) — and the target's own
  prefill tokens/s (logits and hidden states, as the dump runs it) in fp32 and bf16: whether bf16 pays on
  this CPU (``lscpu`` flags avx512_bf16 / amx are recorded).
* ``stages``: read from a finished run's workdir (each stage's ``DONE`` record): wall time, tokens, tokens/s,
  and the CPU limit ``FLOPs per token x tokens / FLOP/s`` at the stage's dtype — a forward costs about
  2 x parameters per token, a training step 3 x that over the draft's parameters times the positions it
  unrolls — and ``limit_s / wall_s``, how close the stage came to it.

The host is shared: the load average is sampled during the machine measurement and recorded; a run's own load is
what its log says (pass ``--load`` with the figures you watched).

Usage: ``python -m benchmarks.real_model_stages OUT.json --target targets/smollm2 --workdir runs-smollm2``
(``--workdir`` optional: without it only the machine is measured).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.host import LoadSampler, write_result

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cpu_flags() -> list[str]:
    """The matrix-unit flags of this CPU (avx512_bf16, amx_*) as ``lscpu`` lists them."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return []
    return sorted(set(re.findall(r"\b(avx512_bf16|avx512f|amx_\w+)\b", text)))


def matmul_flops(dtype: torch.dtype, threads: int, *, m: int = 2048, k: int = 576, n: int = 1536,
                 seconds: float = 3.0) -> float:
    """FLOP/s of a (m, k) @ (k, n) product repeated for ``seconds`` with ``threads`` torch threads."""
    torch.set_num_threads(threads)
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)  # (m, k), (k, n)
    for _ in range(3):
        a @ b  # warm the kernels
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        a @ b  # (m, n)
        count += 1
    return 2 * m * k * n * count / (time.perf_counter() - started)


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
    with LoadSampler(every=1.0) as load:
        flops = {name: round(matmul_flops(dt, threads) / 1e9, 1) for name, dt in DTYPES.items()}
        flops_1 = {name: round(matmul_flops(dt, 1) / 1e9, 1) for name, dt in DTYPES.items()}
        prefill = {name: prefill_rate(target, dt, threads) for name, dt in DTYPES.items()} if target else {}
    return {"cpu_flags": cpu_flags(), "threads": threads,
            "matmul_gflops": flops, "matmul_gflops_1_thread": flops_1,
            "matmul_shape": [2048, 576, 1536], "prefill": prefill, "load": load.summary()}


def _done(workdir: Path, stage: str) -> dict[str, Any] | None:
    """The newest ``DONE`` record of ``stage`` in a run's workdir (None: the stage has not finished)."""
    files = sorted((workdir / stage).glob("*/DONE"), key=lambda f: f.stat().st_mtime)
    return json.loads(files[-1].read_text()) if files else None


def draft_parameters(draft: Path) -> dict[str, int]:
    """The draft's parameters that cost FLOPs per token (every 2-D weight but the token embedding), trained or not."""
    from safetensors import safe_open

    counts = {"matmul": 0, "embedding": 0}
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            if len(shape) == 2:
                n = shape[0] * shape[1]
                counts["embedding" if "embed" in name else "matmul"] += n
    return counts


def limit(flops_per_token: float, tokens: float, flops: float, wall_s: float) -> dict[str, Any]:
    """The CPU limit of ``tokens`` at ``flops_per_token`` on ``flops`` FLOP/s, and how close ``wall_s`` came to it."""
    limit_s = flops_per_token * tokens / flops
    return {"flops_per_token": round(flops_per_token), "tokens": int(tokens), "limit_s": round(limit_s, 1),
            "limit_tokens_per_s": round(tokens / limit_s, 1), "limit_over_wall": round(limit_s / wall_s, 3)}


def stage_rows(workdir: Path, target_params: int, gflops: dict[str, float], dump_dtype: str, train_dtype: str,
               val_fraction: float, epochs: int) -> dict[str, Any]:
    """Per stage: wall, tokens, tokens/s from the stage's own record, and the CPU limit beside them."""
    rows: dict[str, Any] = {}
    if (reg := _done(workdir, "regenerate")) is not None:
        s = reg["summary"]
        tokens = s["prompt_tokens"] + s["tokens_generated"]  # prefill + one forward per generated token
        rows["regenerate"] = {"wall_s": round(reg["wall_s"], 1), "generated_tokens": s["tokens_generated"],
                              "prompt_tokens": s["prompt_tokens"], "generate_s": s["generate_s"],
                              "generated_tokens_per_s": s["generate_tokens_per_s"],
                              "cpu_limit_fp32": limit(2 * target_params, tokens, gflops["float32"] * 1e9, s["generate_s"]),
                              "note": "vLLM's engine computes on 1 of the 2 cores (it reserves the other); decoding "
                                      "is memory-bound: the FLOP limit is a floor it cannot reach"}
    if (dump := _done(workdir, "features")) is not None:
        s = dump["summary"]
        rows["dump"] = {"wall_s": round(dump["wall_s"], 1), "tokens": s["tokens"], "tokens_per_s": s["tokens_per_s"],
                        "actor_tokens_per_s": s["features_tokens_per_s"], "bytes_per_token": s["bytes_per_token"],
                        "dtype": dump_dtype,
                        "cpu_limit": limit(2 * target_params, s["tokens"], gflops[dump_dtype] * 1e9, dump["wall_s"])}
    if (train := _done(workdir, "train")) is not None and dump is not None:
        params = draft_parameters(Path(train["draft"]))
        tokens = dump["summary"]["tokens"] * (1 - val_fraction) * epochs  # every position runs the draft
        metrics = [json.loads(line) for line in Path(train["metrics_file"]).read_text().splitlines() if line.strip()]
        rates = [m["tokens_per_s"] for m in metrics if "tokens_per_s" in m]
        rows["train"] = {"wall_s": round(train["wall_s"], 1), "epochs": epochs, "positions": int(tokens),
                         "loss_tokens_per_s_logged": round(sum(rates) / len(rates), 1) if rates else None,
                         "positions_per_s": round(tokens / train["wall_s"], 1), "draft_parameters": params,
                         "dtype": train_dtype,
                         "cpu_limit": limit(6 * params["matmul"], tokens, gflops[train_dtype] * 1e9, train["wall_s"])}
    if (ev := _done(workdir, "eval")) is not None:
        report = json.loads(Path(ev["report"]).read_text())
        rows["eval"] = {"wall_s": round(ev["wall_s"], 1), "tau": ev["tau"], "tau_pld": ev["tau_pld"],
                        "engine_tau": ev["engine_tau"], "lossless_mismatches": ev["lossless_mismatches"],
                        "report_keys": sorted(report)}
    if (exp := _done(workdir, "export")) is not None:
        rows["export"] = {"wall_s": round(exp["wall_s"], 1), "exports": sorted(exp["exports"])}
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON result path")
    parser.add_argument("--target", default="targets/smollm2")
    parser.add_argument("--workdir", default=None, help="a finished run's workdir (its stages' DONE records)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dump-dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--train-dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--epochs", type=int, default=2, help="the run's train.epochs")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--load", default="", help="the load average the run itself ran under (text)")
    args = parser.parse_args(argv)

    machine = measure_machine(args.target, args.threads)
    result: dict[str, Any] = {"benchmark": "real_model_stages", "machine": machine}  # its speed; write_result: the host
    if args.workdir:
        params = machine["prefill"]["float32"]["parameters"] if machine["prefill"] else 0
        result["stages"] = stage_rows(Path(args.workdir), params, machine["matmul_gflops"], args.dump_dtype,
                                      args.train_dtype, args.val_fraction, args.epochs)
        result["run_load"] = args.load
    print(write_result(args.out, result).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Does a reported speedup survive a busy machine? Issue 41's "done means": `specdraft eval`'s speedups on the toy
target (draft over vanilla, prompt lookup over vanilla) measured on a quiet machine and with busy loops competing
for its cores, interleaved, each speedup's two times from one evaluation ("Fast Inference from Transformers via
Speculative Decoding", §3.4: a speedup is a ratio of two decode times on the same tokens).

A toy target and a draft trained on it come from ``benchmarks.decoding.prepare`` (cached under ``--work``). Then
``--reps`` times, in alternating order, ``specdraft eval`` runs as a user runs it (a fresh process, the baseline
cache off, so every time in its report is this run's) once on the machine as it is and once beside ``--busy``
processes spinning in a Python loop. The JSON keeps every evaluation's speedups, tokens/s and the load average
its turns ran under, and per decoder the loaded mean over the quiet mean (the issue's goal: within 15 %).

    python -m benchmarks.eval_load benchmarks/results/eval_load_cpu.json [--reps 3] [--busy 2] [--mode chain]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.decoding import prepare
from benchmarks.host import write_result

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT / "configs" / "data" / "toy_questions.jsonl"
SPIN = "while True: pass"


def evaluate(target: Path, draft: Path, out: Path, mode: str, max_questions: int) -> dict[str, Any]:
    """One ``specdraft eval`` in its own process; its overall metrics block."""
    cmd = [sys.executable, "-m", "flows.cli", "eval", "--target", str(target), "--draft", str(draft),
           "--questions", str(QUESTIONS), "--out", str(out), "--mode", mode, "--quiet", "baselines=off",
           f"max_questions={max_questions}"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    overall = json.loads(out.read_text())["overall"]
    keep = ("tau", "tau_pld", "tokens_per_s", "baseline_tokens_per_s", "tokens_per_s_pld", "speedup", "speedup_pld",
            "load_1m", "load_1m_max", "lossless_mismatches", "num_turns")
    return {key: overall.get(key) for key in keep}


def busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]


def measure(target: Path, draft: Path, work: Path, reps: int, n_busy: int, mode: str, max_questions: int
            ) -> list[dict[str, Any]]:
    rows = []
    for rep in range(reps):
        order = ("quiet", "loaded") if rep % 2 == 0 else ("loaded", "quiet")
        for condition in order:
            spinners = busy(n_busy) if condition == "loaded" else []
            try:
                time.sleep(2 if spinners else 0)
                t0 = time.perf_counter()
                row = evaluate(target, draft, work / f"eval-{rep}-{condition}.json", mode, max_questions)
            finally:
                for p in spinners:
                    p.kill()
                    p.wait()
            row.update(rep=rep, condition=condition, busy=len(spinners), wall_s=round(time.perf_counter() - t0, 1))
            print(f"rep {rep} {condition:6s}: draft {row['speedup']:.2f}x, prompt lookup {row['speedup_pld']:.2f}x, "
                  f"vanilla {row['baseline_tokens_per_s']:.0f} tokens/s, load {row['load_1m']:.1f}", file=sys.stderr)
            rows.append(row)
            time.sleep(5)  # let the spinners' load leave the 1-minute average a little before the next run
    return rows


def compare(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per speedup: the mean quiet and loaded, loaded over quiet, and whether that is within 15 %."""
    out = {}
    for key in ("speedup", "speedup_pld", "baseline_tokens_per_s"):
        means = {}
        for condition in ("quiet", "loaded"):
            values = [r[key] for r in rows if r["condition"] == condition and r[key] is not None]
            means[condition] = sum(values) / len(values) if values else None
        ratio = means["loaded"] / means["quiet"] if means["quiet"] and means["loaded"] else None
        out[key] = {**means, "loaded_over_quiet": ratio,
                    "within_15pct": None if ratio is None or key == "baseline_tokens_per_s" else abs(ratio - 1) <= 0.15}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "eval-load")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--busy", type=int, default=2, help="spinning processes beside each loaded evaluation")
    parser.add_argument("--mode", choices=("chain", "tree"), default="chain")
    parser.add_argument("--max-questions", type=int, default=8)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    target, draft = prepare(args.work / "toy", {}, "beagle", train_samples=256, epochs=4)
    before = os.getloadavg()
    rows = measure(target, draft, args.work, args.reps, args.busy, args.mode, args.max_questions)
    result = {"benchmark": "eval_load", "mode": args.mode, "reps": args.reps, "busy": args.busy,
              "questions": str(QUESTIONS.relative_to(ROOT)), "max_questions": args.max_questions,
              "evaluations": rows, "comparison": compare(rows)}
    write_result(args.out, result, loadavg_start=before, loadavg_end=os.getloadavg())
    print(json.dumps(result["comparison"], indent=2))


if __name__ == "__main__":
    main()

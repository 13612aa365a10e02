"""Do the default training recipe's defaults learn on a small store? (issue 11.1, "defaults that learn").

The reported case: ``specdraft train --store S --target T --out D`` with the default recipe on 300
regenerated GSM8K-style conversations ran 100 optimizer steps under a 2,000-step warmup and produced
a draft with sim_tau 0.011, without a warning. This benchmark replays exactly that user path on a
small non-toy target and measures what the defaults do now:

1. target: a ``LlamaForCausalLM`` (d=128, 4 layers, GQA, untied head) trained on GSM8K-style
   worked word problems (``specdraft.toy.word_problems``, via ``specdraft.toy.build`` with
   ``data=word_problems``; 1 torch thread), cached under ``--work``;
2. ``specdraft regenerate`` of 300 held-in prompts (the first problems of the target's own training
   set, answers dropped; HF backend on local Ray, greedy), ``specdraft dump`` with default settings;
3. ``specdraft train --store S --target T --out D`` with no flags (default recipe, default config),
   then the same with the OLD defaults passed as explicit overrides (lr 3e-5, a fixed 2000-step
   warmup, constant schedule, no batch shrinking: ``min_steps=0``, ``reader.max_tokens=16384``), and
   today's optimizer defaults without the batch shrinking (``min_steps=0``, ``reader.max_tokens=16384``);
4. ``specdraft eval --mode chain`` of the default run's draft on held-out word problems: real
   chain τ beside the prompt-lookup floor τ_pld.

Every stage runs as its own ``python -m flows.cli ...`` process, as a user would run it (the
train runs side by side: they are independent, and the host this was written on is shared); the
benchmark reads what the train run reports: optimizer steps, the warmup and batch budget it chose,
the warnings it printed, and held-out sim_tau on the run's own validation split (5% of the
conversations by sample-id hash; simulated greedy chain of depth 5, no bonus token) per epoch.
Wall-clock numbers depend on what else the host runs: the 1-minute load average is sampled
throughout and recorded, and so are the CPU seconds of the whole process tree (``TreeCpu``).

    python -m benchmarks.defaults benchmarks/results/defaults_cpu.json [--work runs/bench-defaults]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.host import write_result
from specdraft.limits import LoadSampler

REPO = Path(__file__).resolve().parents[1]
# the defaults before issue 11.1 (specdraft.training.OptimConfig, specdraft.recipes.TrainConfig, ReaderConfig)
OLD_DEFAULTS = ("optim.lr=3e-5", "optim.warmup_steps=2000", "optim.schedule=constant", "optim.min_lr_ratio=0.0",
                "min_steps=0", "reader.max_tokens=16384")
# today's optimizer defaults (relative warmup, lr 1e-3, cosine) without the batch shrinking: which fix matters
NO_SHRINKING = ("min_steps=0", "reader.max_tokens=16384")


def target_config(args: argparse.Namespace):
    from specdraft.configs.toy import ToyTargetConfig

    return ToyTargetConfig(
        seed=args.seed, data="word_problems", num_conversations=args.target_conversations, vocab_size=1024,
        hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384,
        max_position_embeddings=1024, max_seq_len=256, train_steps=args.target_steps, batch_size=args.target_batch,
        lr=3e-3, warmup_steps=20, num_threads=1, num_eval_conversations=128,
    )


class TreeCpu:
    """CPU seconds of this process and all its descendants (stage processes, their Ray clusters and workers).

    ``/proc/PID/stat`` utime + stime of every live descendant, sampled every ``every`` seconds in a
    thread and at each ``total()`` call; a process's last value seen counts, so a process loses at
    most its last ``every`` seconds.
    """

    def __init__(self, every: float = 2.0):
        self.every, self.seen, self.tick = every, {}, os.sysconf("SC_CLK_TCK")
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _scan(self) -> None:
        stats, children = {}, {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            pid, ppid = int(entry), int(fields[1])  # fields[0] is the state (field 3 of stat)
            stats[pid] = (int(fields[19]), (int(fields[11]) + int(fields[12])) / self.tick)  # starttime, utime+stime
            children.setdefault(ppid, []).append(pid)
        todo, tree = [os.getpid()], []
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo += children.get(pid, [])
        with self._lock:
            for pid in tree:
                if pid in stats:
                    start, cpu = stats[pid]
                    self.seen[(pid, start)] = cpu

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._scan()

    def total(self) -> float:
        self._scan()
        with self._lock:
            return sum(self.seen.values())

    def __enter__(self) -> "TreeCpu":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _env() -> dict[str, str]:
    path = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "RAY_DEDUP_LOGS": "0"}


def cli_start(name: str, argv: list[str], log_dir: Path) -> dict[str, Any]:
    """Start ``python -m flows.cli ARGV`` (1 torch thread per process), its output going to ``log_dir/NAME.log``."""
    log = log_dir / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[defaults] {name}: specdraft {' '.join(argv)}", file=sys.stderr, flush=True)
    fh = log.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *argv], cwd=REPO, env=_env(), stdout=fh,
                            stderr=subprocess.STDOUT, text=True)
    return {"name": name, "argv": argv, "log": log, "fh": fh, "proc": proc, "t0": time.perf_counter()}


def cli_finish(run: dict[str, Any]) -> dict[str, Any]:
    """Wait for a ``cli_start`` process: its argv, wall seconds, log and output; raises when it failed."""
    code = run["proc"].wait()
    wall = time.perf_counter() - run["t0"]
    run["fh"].close()
    text = run["log"].read_text()
    if code != 0:
        raise RuntimeError(f"{run['name']} failed (exit {code}); log {run['log']}:\n{text[-3000:]}")
    return {"argv": ["specdraft", *run["argv"]], "wall_s": round(wall, 1), "log": str(run["log"]), "output": text}


def cli(name: str, argv: list[str], log_dir: Path, cpu: TreeCpu) -> dict[str, Any]:
    """``cli_start`` + ``cli_finish``, with the CPU seconds of the process tree meanwhile."""
    c0 = cpu.total()
    out = cli_finish(cli_start(name, argv, log_dir))
    return {**out, "cpu_s": round(cpu.total() - c0, 1)}


def write_prompts(path: Path, conversations: int, seed: int) -> Path:
    """The first ``conversations`` problems of the target's training set, answers dropped (OpenAI messages)."""
    from specdraft.toy.word_problems import generate_prompts

    rows = [{"id": f"wp-{seed}-{i:04d}", "messages": m} for i, m in enumerate(generate_prompts(conversations, seed))]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_questions(path: Path, n: int, seed: int) -> Path:
    """Held-out problems (another seed than the target's data) as MT-Bench-format questions."""
    from specdraft.toy.word_problems import generate_prompts

    rows = [{"question_id": i, "category": "word_problems", "turns": [m[-1]["content"]]}
            for i, m in enumerate(generate_prompts(n, seed))]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_train_run(out: Path, output: str) -> dict[str, Any]:
    """What a train run reported: its plan (params), per-epoch held-out sim_tau, the lines it printed."""
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    params = next(r for r in records if r["kind"] == "params")
    epochs = [r for r in records if r["kind"] == "metrics" and "sim_tau" in r]
    steps = [r for r in records if r["kind"] == "metrics" and "loss" in r]
    losses: dict[str, list[float]] = {}  # per stage: the late stage sums weighted sub-step losses (another scale)
    for r in steps:
        losses.setdefault(str(int(r["stage"])), []).append(round(r["loss"], 4))
    printed = [re.sub(r"^.*?\[specdraft\]", "[specdraft]", x) for x in output.splitlines() if "[specdraft]" in x]
    lines = list(dict.fromkeys(printed))  # Ray forwards each worker line to the driver twice
    final = epochs[-1]
    return {
        "optimizer_steps": params["train.total_steps"],
        "warmup_steps_used": params["train.warmup_used"],
        "batch_max_tokens_used": params["train.max_tokens_used"],
        "batches_per_epoch": params["train.batches_per_epoch"],
        "peak_lr": params["train.optim.lr"],
        "schedule": params["train.optim.schedule"],
        "warnings": [] if params["train.warnings"] == "none" else params["train.warnings"].split(" | "),
        "printed_plan": [x for x in lines if "optimizer steps (" in x],
        "printed_warnings": [x for x in lines if "WARNING" in x],
        "sim_tau": round(final["sim_tau"], 4),
        "alpha": [round(final[f"alpha_{i}"], 4) for i in range(1, 6) if f"alpha_{i}" in final],
        "sim_tau_per_epoch": [[r["step"], round(r["sim_tau"], 4)] for r in epochs],
        "loss_first_last_per_stage": {stage: [v[0], v[-1]] for stage, v in losses.items()},
        "lr_first_peak_last": [steps[0]["lr"], max(r["lr"] for r in steps), steps[-1]["lr"]] if steps else None,
    }


def train_start(name: str, store: Path, target: Path, work: Path, overrides: tuple[str, ...]) -> dict[str, Any]:
    """Start ``specdraft train --store S --target T --out D [overrides]``; a finished run is read again
    (no process), a partial one restarted from scratch (the same ``--out`` would resume it)."""
    out = work / f"train-{name}"
    marker, log = out / "bench_overrides.json", work / "logs" / f"train-{name}.log"
    argv = ["train", "--store", str(store), "--target", str(target), "--out", str(out), *overrides]
    job = {"name": name, "out": out, "overrides": list(overrides), "argv": argv}
    if ((out / "train_summary.json").is_file() and marker.is_file()
            and json.loads(marker.read_text()) == list(overrides) and log.is_file()):
        return {**job, "reused": {"argv": ["specdraft", *argv], "wall_s": None, "output": log.read_text()}}
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    marker.write_text(json.dumps(list(overrides)))
    return {**job, "run": cli_start(f"train-{name}", argv, work / "logs")}


def train_finish(job: dict[str, Any]) -> dict[str, Any]:
    """Wait for a ``train_start`` job; what its run reported."""
    run = job.get("reused") or cli_finish(job["run"])
    return {"overrides": job["overrides"], "argv": run["argv"], "wall_s": run["wall_s"], "reused": "reused" in job,
            "draft": str(job["out"] / "draft"), **read_train_run(job["out"], run["output"])}


def split_sizes(store: Path) -> dict[str, int]:
    """Sequences in the train run's default train / validation split of ``store``."""
    from specdraft.configs.train import TrainConfig
    from specdraft.store import FeatureDataset

    reader = TrainConfig().reader
    return {split: sum(len(b) for b in FeatureDataset([store], reader, split=split).batches(0))
            for split in ("train", "val")}


def evaluate(name: str, target: Path, draft: str, questions: Path, work: Path, n: int, cpu: TreeCpu) -> dict[str, Any]:
    """``specdraft eval --mode chain`` on ``n`` held-out questions (reused when its report exists)."""
    report = work / f"eval-{name}.json"
    run = None
    if not report.is_file():
        run = cli(f"eval-{name}", ["eval", "--target", str(target), "--draft", draft, "--questions", str(questions),
                                   "--out", str(report), "--mode", "chain", "--quiet", f"max_questions={n}"],
                  work / "logs", cpu)
    data = json.loads(report.read_text())
    d = next(iter(data["datasets"].values()))
    keep = ("tau", "alpha", "tau_pld", "alpha_pld", "tau_over_pld", "speedup", "tokens_per_s",
            "baseline_tokens_per_s", "lossless_checked", "lossless_mismatches", "pld_lossless")
    return {"report": str(report), "gamma": data["settings"]["decode"]["gamma"],
            "turns_decoded": sum(t["num_turns"] for t in d["turns"].values()),
            "new_tokens": sum(t["new_tokens"] for t in d["turns"].values()), **{k: d[k] for k in keep if k in d},
            "wall_s": None if run is None else run["wall_s"], "cpu_s": None if run is None else run["cpu_s"],
            "reused": run is None}


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The benchmark's flags."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON result path")
    ap.add_argument("--work", default="runs/bench-defaults", help="target, prompts, regenerated data, store, runs")
    ap.add_argument("--seed", type=int, default=0, help="target seed (its training problems: this seed)")
    ap.add_argument("--target-conversations", type=int, default=8000)
    ap.add_argument("--target-steps", type=int, default=800)
    ap.add_argument("--target-batch", type=int, default=16)
    ap.add_argument("--conversations", type=int, default=300, help="held-in prompts regenerated into the store")
    ap.add_argument("--questions", type=int, default=20, help="held-out problems for the real chain eval")
    ap.add_argument("--question-seed", type=int, default=4242)
    ap.add_argument("--skip-old", action="store_true", help="only the default run (no old-defaults contrast runs)")
    ap.add_argument("--skip-eval", action="store_true", help="no real speculative decoding")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    from specdraft.store import read_manifest
    from specdraft.toy.build import build_toy_target, is_complete_build, read_build_record

    hf_logging.disable_progress_bar()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    phases: dict[str, Any] = {}
    result: dict[str, Any] = {"benchmark": "defaults", "settings": {k: v for k, v in vars(args).items() if k != "out"}}

    with LoadSampler() as load, TreeCpu() as cpu:
        t0, c0 = time.perf_counter(), cpu.total()
        print("[defaults] target ...", file=sys.stderr, flush=True)
        cached = is_complete_build(work / "target", target_config(args))
        target = build_toy_target(work / "target", target_config(args), progress=False)
        rec = read_build_record(target)
        phases["target"] = {"wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(cpu.total() - c0, 1),
                            "reused": cached}
        result["target"] = {"dir": str(target), "config": rec["config"], "num_parameters": rec["num_parameters"],
                            "final_loss": rec["final_loss"], "eval_loss": rec["eval_loss"],
                            "build_s": rec["wall_time_s"], "train_time_s": rec["train_time_s"],
                            "note": "build_s: wall seconds of the build that wrote it (cached under --work)"}

        prompts = write_prompts(work / "prompts" / "word_problems.jsonl", args.conversations, args.seed)
        questions = write_questions(work / "questions" / "word_problems.jsonl", args.questions, args.question_seed)
        regenerated, store = work / "regenerated", work / "store"
        run = cli("regenerate", ["regenerate", "--target", str(target), "--prompts", str(prompts),
                                 "--out", str(regenerated), "--quiet"], work / "logs", cpu)
        phases["regenerate"] = {k: run[k] for k in ("wall_s", "cpu_s")}
        summary = json.loads((regenerated / "summary.json").read_text())
        result["regenerate"] = {"argv": run["argv"], **{k: summary[k] for k in (
            "rows_out", "rows_skipped", "rows_total", "turns", "truncated_turns", "empty_answers",
            "tokens_generated", "generate_tokens_per_s")}}

        run = cli("dump", ["dump", "--target", str(target), "--prompts", str(regenerated), "--out", str(store),
                           "--quiet"], work / "logs", cpu)
        phases["dump"] = {k: run[k] for k in ("wall_s", "cpu_s")}
        totals = read_manifest(store)["totals"]
        result["store"] = {"argv": run["argv"], "dir": str(store), "sequences": totals["sequences"],
                           "tokens": totals["tokens"], "loss_tokens": totals["loss_tokens"],
                           "split": split_sizes(store)}

        runs = {"default": ()} if args.skip_old else {"default": (), "old_defaults": OLD_DEFAULTS,
                                                        "no_batch_shrinking": NO_SHRINKING}
        # the runs are independent: on a busy shared host they run side by side (each on its own local Ray)
        t0, c0 = time.perf_counter(), cpu.total()
        jobs = {name: train_start(name, store, target, work, overrides) for name, overrides in runs.items()}
        result["train"] = {name: train_finish(job) for name, job in jobs.items()}
        phases["train"] = {"wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(cpu.total() - c0, 1),
                           "runs_side_by_side": len(runs), "reused": [n for n, r in result["train"].items() if r["reused"]]}
        for name, r in result["train"].items():
            print(f"[defaults]   {name}: {r['optimizer_steps']} steps, warmup {r['warmup_steps_used']}, "
                  f"max_tokens {r['batch_max_tokens_used']}, sim_tau {r['sim_tau']}, warnings {len(r['warnings'])}",
                  file=sys.stderr, flush=True)

        if not args.skip_eval:
            result["eval"] = {"default": evaluate("default", target, result["train"]["default"]["draft"], questions,
                                                  work, args.questions, cpu)}
            phases["eval"] = {k: result["eval"]["default"][k] for k in ("wall_s", "cpu_s")}
        cpu_total = cpu.total()

    result["host"] = {"torch_threads": 1, "device": "cpu", "load": load.summary()}  # write_result adds the host's facts
    result["phases"] = phases
    result["total_s"] = round(time.perf_counter() - started, 1)
    result["cpu_s"] = round(cpu_total, 1)
    result["cpu_note"] = "utime + stime of this process and all its descendants (Ray clusters included), /proc sampled every 2 s"
    path = write_result(args.out, result)
    print_summary(result)
    print(f"written: {path}")
    return 0


def print_summary(result: dict[str, Any]) -> None:
    print(f"store: {result['store']['sequences']} conversations ({result['store']['split']}), "
          f"{result['store']['loss_tokens']} loss tokens")
    for name, r in result["train"].items():
        print(f"{name:13s} steps {r['optimizer_steps']:5d}  warmup {r['warmup_steps_used']:5d}  max_tokens "
              f"{r['batch_max_tokens_used']:6d}  held-out sim_tau {r['sim_tau']:.3f}  warnings {len(r['warnings'])}")
        for w in r["warnings"]:
            print(f"{'':13s} WARNING {w}")
    if "eval" in result:
        e = result["eval"]["default"]
        print(f"chain eval (gamma {e['gamma']}, {e['turns_decoded']} held-out problems): tau {e['tau']:.3f} vs tau_pld "
              f"{e['tau_pld']:.3f}; lossless {e['lossless_checked'] - e['lossless_mismatches']}/{e['lossless_checked']}")
    load = result["host"]["load"]
    print(f"load avg (1m): min {load['load_1m_min']} mean {load['load_1m_mean']} max {load['load_1m_max']} on "
          f"{load['cpus']} CPUs; total {result['total_s']:.0f} s, CPU {result['cpu_s']:.0f} s")


if __name__ == "__main__":
    raise SystemExit(main())

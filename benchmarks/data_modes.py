"""Data modes at equal CPU time (issue 40, Deliver 1): the target's own answers, the answers as they ship, and a
mix — each buying its training data with the same CPU seconds, each draft judged by vLLM.

``regenerate.mode`` (``pipelines/shipped.py``): ``target`` pays a generation per answer token, ``shipped`` only
the dump's prefill, ``mixed`` a ``--share`` of the generations. At equal CPU time ``shipped`` buys many times the
tokens; EAGLE (Table 6) found fixed ShareGPT answers cost ~3.6 % of τ. This benchmark measures which wins here.

Per mode, on the same ordered pool of conversations (``--prompts`` ingested once, the first ``--pool``; not
charged to any mode):

1. **data** — regenerate (``pipelines.regenerate``, the mode's setting) and dump (``pipelines.dump``, the
   EAGLE-3 aux layers) are charged the CPU seconds of this process and every process it starts
   (``benchmarks.host.CpuMeter``: Ray's workers, the engines). A calibration charged to no mode measures what
   each costs here (two runs of each: a fixed part — starts, the target's load — and a part per regenerated
   row or per character prefilled); each mode then takes the most pool rows whose estimate fits
   ``--budget-cpu-s`` (the rows ``mixed`` regenerates are known in advance) and runs one regenerate and one
   dump over them, measured: ``data_cpu_s`` beside the budget and the estimate shows how equal they came out; The dump then runs once and the mode's data CPU
   is what the meter measured for both (``data_cpu_s``, beside the budget: the estimate's miss is visible);
2. **train** — ``--recipe`` for ``--epochs`` over the mode's own store (``benchmarks.recipe_training``, a spawned
   process): more data, more steps, as a run would train it (``--steps``: equal optimizer steps instead);
3. **serve** — every mode's draft in one vLLM process on the held-out questions at K = ``--k``, beside vLLM's
   ``ngram`` (``benchmarks.speculative.engine_acceptance``): acceptance length and tokens/s over no draft.

One JSON holds the settings, each mode's data (rows regenerated / shipped / rejected, tokens, CPU), training and
engine numbers, the machine and the load sampled throughout (``benchmarks.host``); a table is printed. For real
(SmolLM2, ``configs/smollm2.yaml``'s target; a quiet machine, ~2-3 hours)::

    python -m benchmarks.data_modes --target targets/smollm2 --budget-cpu-s 1800 --epochs 4 \\
        --out benchmarks/results/data_modes_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.host import CpuMeter
from specdraft.limits import LoadSampler

ROOT = Path(__file__).resolve().parents[1]
MODES = ("target", "shipped", "mixed")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, type=Path, help="the target model directory")
    ap.add_argument("--prompts", nargs="+", default=["sharegpt"], help="conversations with answers (default: ShareGPT)")
    ap.add_argument("--pool", type=int, default=20000, help="the first N ingested conversations every mode draws from")
    ap.add_argument("--budget-cpu-s", type=float, required=True, help="CPU seconds of data production per mode")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--share", type=float, default=0.25, help="mixed: the share the target regenerates")
    ap.add_argument("--calibrate", type=int, default=64,
                    help="rows of the larger calibration run (the smaller: a quarter); span several regenerate "
                         "batches (batch_size 16): a batch costs about its longest answer, not its row count")
    ap.add_argument("--backend", choices=["hf", "vllm"], default="vllm")
    ap.add_argument("--regen-max-new-tokens", type=int, default=128)
    ap.add_argument("--regen-cpus", type=int, default=2,
                    help="CPUs of the regenerating replica; vLLM computes on all of them (configs/smollm2.yaml's "
                         "vllm_env: none reserved for its scheduler), 1: vLLM's default of one core")
    ap.add_argument("--max-length", type=int, default=1024, help="the dump's tokens per conversation")
    ap.add_argument("--dtype", default="bfloat16", help="the dump's prefill dtype")
    ap.add_argument("--max-turns", type=int, default=1)
    ap.add_argument("--max-chars", type=int, default=4000)
    ap.add_argument("--recipe", default="beagle3")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="the draft head's tokens (0: the target's vocabulary)")
    ap.add_argument("--precision", default="bf16", help="training precision (auto, fp32, bf16)")
    ap.add_argument("--epochs", type=int, default=2, help="epochs over each mode's own store")
    ap.add_argument("--steps", type=int, default=None, help="equal optimizer steps instead (steps // epochs a epoch)")
    ap.add_argument("--max-tokens", type=int, default=1024, help="padded tokens per batch")
    ap.add_argument("--questions", type=Path, nargs="+", default=[ROOT / "configs" / "data" / "mt_bench.jsonl"])
    ap.add_argument("--max-questions", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128, help="per evaluated answer")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--engine-max-len", type=int, default=2048)
    ap.add_argument("--no-engine", action="store_true", help="no vLLM: the held-out simulated acceptance only")
    ap.add_argument("--ray-cpus", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the dump and of training")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=Path("runs/bench-data-modes"))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "data_modes_cpu.json")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := set(args.modes) - set(MODES):
        ap.error(f"--modes: unknown {sorted(unknown)}; choose from {list(MODES)}")
    return args


def regenerate_config(args: argparse.Namespace, mode: str, limit: int):
    from pipelines.configs import IngestConfig, RegenerateConfig

    vllm = args.backend == "vllm"
    engine = {"kv_cache_memory_bytes": 512 << 20, "enforce_eager": True} if vllm else {}
    env = ({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.regen_cpus - 1}"}
           if vllm and args.regen_cpus > 1 else {})
    return RegenerateConfig(mode=mode, share=args.share if mode == "mixed" else None, backend=args.backend,
                            temperature=0.0, max_new_tokens=args.regen_max_new_tokens, max_model_len=args.engine_max_len,
                            limit=limit, num_cpus=args.regen_cpus, seed=args.seed, vllm_engine_kwargs=engine,
                            vllm_env=env,
                            ingest=IngestConfig(max_turns=args.max_turns, max_chars=args.max_chars))


def dump_config(args: argparse.Namespace):
    from pipelines.configs import DumpConfig

    return DumpConfig(max_length=args.max_length, aux_layers="eagle3", dtype=args.dtype, cpus_per_actor=1,
                      torch_threads=args.threads, batch_tokens=2048, logits_chunk=512)  # configs/smollm2.yaml's


def write_pool(args: argparse.Namespace, work: Path) -> tuple[Path, dict[str, Any]]:
    """The first ``--pool`` conversations ingest keeps of ``--prompts``, in our schema, in their order."""
    from pipelines.configs import IngestConfig
    from pipelines.ingest import ingest
    from specdraft.packaged import resolve_prompt_inputs

    rows, summary = ingest(resolve_prompt_inputs(list(args.prompts)),
                           IngestConfig(max_turns=args.max_turns, max_chars=args.max_chars))
    rows = rows[: args.pool]
    path = work / "pool.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": r["id"], "source": "pool", "messages": r["messages"]}) + "\n"
                            for r in rows))
    return path, {"rows": len(rows), "ingest_rows_in": summary["rows_in"], "rejected": summary["rejects_by_reason"]}


def chars(conversations_dir: Path, role: str | None = None) -> int:
    """Characters of the conversations' messages (of ``role``'s only)."""
    from pipelines.conversations import read_conversations

    return sum(len(m["content"]) for r in read_conversations(conversations_dir) for m in r["messages"]
               if role in (None, m["role"]))


def dump(args: argparse.Namespace, target: Path, conversations_dir: Path, store: Path) -> dict[str, Any]:
    """The dump of ``conversations_dir`` into ``store``, its CPU measured."""
    from pipelines.conversations import read_conversations
    from pipelines.dump import dump_features

    shutil.rmtree(store, ignore_errors=True)
    with CpuMeter() as meter:
        t0 = time.perf_counter()
        summary = dump_features(target, read_conversations(conversations_dir), store, dump_config(args),
                                progress=False, lines=False)
    return {"cpu_s": meter.cpu_s, "wall_s": round(time.perf_counter() - t0, 1), "tokens": summary["tokens"],
            "loss_tokens": summary["loss_tokens"], "sequences": summary["rows_out"], "chars": chars(conversations_dir)}


def line(points: list[dict[str, Any]], x: str) -> tuple[float, float]:
    """``(fixed, per unit of x)`` of the CPU seconds through two measured points (a noisy host's second point no
    dearer than its first: all of the larger's cost per unit, nothing fixed)."""
    small, large = points
    per = (large["cpu_s"] - small["cpu_s"]) / max(1, large[x] - small[x])
    if per <= 0:
        return 0.0, large["cpu_s"] / max(1, large[x])
    return max(0.0, large["cpu_s"] - per * large[x]), per


def calibrate(args: argparse.Namespace, target: Path, pool: Path, work: Path) -> dict[str, Any]:
    """What data costs here, charged to no mode: the target's regeneration (``fixed + per row``: its replica's start
    and the target's load, then the generation) and the dump (``fixed + per character``: Ray's workers and the
    actor's target load, then the prefill), each through two runs on the first pool rows (a quarter of
    ``--calibrate``, then all of it; a warm-up run before them); and the characters a regenerated row's answers
    add."""
    from pipelines.regenerate import regenerate

    regen, dumps = [], []
    small = max(1, args.calibrate // 4)
    for rows in (small, small, args.calibrate):  # the first: a warm-up (the first call's imports), not kept
        out = work / "calibrate" / str(rows)
        shutil.rmtree(out, ignore_errors=True)
        regenerate(target, [pool], out / "shipped", regenerate_config(args, "shipped", rows), progress=False)
        dumps.append({"rows": rows, **dump(args, target, out / "shipped", out / "store")})
        with CpuMeter() as meter:
            s = regenerate(target, [pool], out / "target", regenerate_config(args, "target", rows), progress=False)
        regen.append({"rows": rows, "cpu_s": meter.cpu_s, "tokens_generated": s["tokens_generated"],
                      "answer_chars": chars(out / "target", "assistant")})
    regen, dumps = regen[1:], dumps[1:]
    regen_fixed, per_row = line(regen, "rows")
    dump_fixed, per_char = line(dumps, "chars")
    return {"regenerate": regen, "dump": dumps, "regenerate_fixed_cpu_s": round(regen_fixed, 2),
            "regenerate_cpu_s_per_row": round(per_row, 4), "dump_fixed_cpu_s": round(dump_fixed, 2),
            "dump_cpu_s_per_char": per_char, "answer_chars_per_row": regen[1]["answer_chars"] / regen[1]["rows"]}


def rows_for_budget(args: argparse.Namespace, mode: str, pool: Path, cal: dict[str, Any]) -> tuple[int, float]:
    """The most pool rows the mode's data fits in ``--budget-cpu-s`` by the calibration (the rows it regenerates
    known in advance: ``pipelines.shipped.regenerates``), and that estimate."""
    from pipelines.shipped import regenerates, shipped_messages

    cfg = regenerate_config(args, mode, None)
    regenerated, text, best = 0, 0, (0, 0.0)
    for n, line_ in enumerate(pool.read_text().splitlines(), 1):
        messages = json.loads(line_)["messages"]
        if regenerates(messages, cfg):
            regenerated += 1
            text += sum(len(m["content"]) for m in messages if m["role"] != "assistant") + cal["answer_chars_per_row"]
        else:
            text += sum(len(m["content"]) for m in (shipped_messages(messages) or ([], 0))[0])
        estimate = ((cal["regenerate_fixed_cpu_s"] + cal["regenerate_cpu_s_per_row"] * regenerated if regenerated
                     else 0.0) + cal["dump_fixed_cpu_s"] + cal["dump_cpu_s_per_char"] * text)
        if estimate > args.budget_cpu_s:
            break
        best = (n, round(estimate, 1))
    return best


def produce(args: argparse.Namespace, mode: str, target: Path, pool: Path, cal: dict[str, Any]) -> dict[str, Any]:
    """A mode's data within the budget (module docstring, step 1): one regenerate of the rows the calibration
    says the budget buys, one dump, both measured."""
    from pipelines.regenerate import regenerate

    out = args.work.resolve() / mode
    shutil.rmtree(out, ignore_errors=True)
    rows, estimate = rows_for_budget(args, mode, pool, cal)
    if rows == 0:
        raise SystemExit(f"--budget-cpu-s {args.budget_cpu_s}: buys no row in mode {mode} (its fixed costs alone: "
                         f"regenerate {cal['regenerate_fixed_cpu_s']} s, dump {cal['dump_fixed_cpu_s']} s)")
    print(f"[data_modes] {mode}: {rows} rows fit {args.budget_cpu_s:.0f} CPU s (estimated {estimate})",
          file=sys.stderr, flush=True)
    with CpuMeter() as meter:
        summary = regenerate(target, [pool], out / "conversations", regenerate_config(args, mode, rows),
                             progress=False)
    dumped = dump(args, target, out / "conversations", out / "store")
    keys = ("rows_regenerated", "rows_shipped", "rows_no_answer", "rows_rejected", "rejects_by_reason",
            "shipped_cut_turns", "tokens_generated")
    return {"rows": rows, **{k: summary[k] for k in keys}, "estimated_data_cpu_s": estimate,
            "regenerate_cpu_s": meter.cpu_s, "regenerate_wall_s": summary["wall_s"], "dump": dumped,
            "data_cpu_s": round(meter.cpu_s + dumped["cpu_s"], 2), "budget_cpu_s": args.budget_cpu_s,
            "over_budget": round((meter.cpu_s + dumped["cpu_s"]) / args.budget_cpu_s - 1, 3),  # > 0.1: recalibrate
            "store": str(out / "store")}


def train(args: argparse.Namespace, mode: str, store: Path, target: Path, work: Path) -> dict[str, Any]:
    """``--recipe`` on the mode's store in a spawned process (``benchmarks.recipe_training``)."""
    from benchmarks.recipe_training import SHARED, train_in_fresh_process
    from specdraft.configs.train import OptimConfig

    optim = OptimConfig()
    shared = {k: None for k in SHARED} | {
        "threads": args.threads, "seed": args.seed, "epochs": args.epochs, "max_tokens": args.max_tokens,
        "lr": optim.lr, "warmup": None, "schedule": optim.schedule, "min_lr_ratio": optim.min_lr_ratio,
        "sim_depth": 5, "val_fraction": 0.05, "precision": args.precision, "draft_vocab": args.draft_vocab or None,
        "epoch_batches": args.steps // args.epochs if args.steps else None}
    out = work / "drafts" / mode
    shutil.rmtree(out, ignore_errors=True)
    with CpuMeter() as meter:
        result = train_in_fresh_process(shared, args.recipe, store, target, out)
    return {**result, "train_process_cpu_s": meter.cpu_s}


def serve(args: argparse.Namespace, target: Path, drafts: dict[str, Path], work: Path) -> dict[str, Any]:
    """Every mode's draft and vLLM's ngram in one vLLM process at K = ``--k`` on the held-out questions."""
    from benchmarks.real_model import write_question_sets
    from benchmarks.speculative import engine_acceptance

    files = write_question_sets(args.questions, work / "questions", args.max_questions)
    return engine_acceptance(target, drafts, files, work / "engine", args.max_new_tokens, args.k, floor=True,
                             max_model_len=args.engine_max_len, ours=False)


def engine_numbers(engine: dict[str, Any] | None, name: str) -> dict[str, dict[str, Any]]:
    """``{question set: {acceptance_length, speedup}}`` of one drafter in ``serve``'s report."""
    report = (engine or {}).get(name) or {}
    return {s: {"acceptance_length": d.get("acceptance_length"), "speedup": d.get("speedup")}
            for s, d in report.get("datasets", {}).items()}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from benchmarks.host import write_result
    from benchmarks.real_model import settings_of, target_facts
    from pipelines.cluster import connect_ray

    work, target = args.work.resolve(), args.target.resolve()
    started, modes, engine = time.perf_counter(), {}, None
    connect_ray(num_cpus=args.ray_cpus)  # before any meter: Ray's start is no mode's cost

    def write(complete: bool) -> dict[str, Any]:
        result = {"benchmark": "data_modes", "complete": complete, "note": args.note, "settings": settings_of(args),
                  "target": target_facts(target), "pool": pool_facts, "calibration": calibration,
                  "modes": {m: {**r, "engine": engine_numbers(engine, m)} for m, r in modes.items()},
                  "ngram": engine_numbers(engine, "ngram"), "engine_report": engine,
                  "total_s": round(time.perf_counter() - started, 1)}
        summary = load.summary()
        write_result(args.out, result, threads=args.threads, load=summary)
        return {**result, "load": summary}

    with LoadSampler() as load:
        pool, pool_facts = write_pool(args, work)
        calibration = calibrate(args, target, pool, work)
        for mode in args.modes:
            modes[mode] = produce(args, mode, target, pool, calibration)
            modes[mode]["train"] = train(args, mode, Path(modes[mode]["store"]), target, work)
            write(False)
        if not args.no_engine:
            engine = serve(args, target, {m: Path(r["train"]["draft"]) for m, r in modes.items()}, work)
    result = write(True)
    print_table(result)
    print(f"written: {args.out}")
    return 0


def print_table(result: dict[str, Any]) -> None:
    """One line per mode: the data bought, its CPU, training, acceptance (simulated; vLLM's per question set)."""
    f = lambda x, spec=".2f": "-" if x is None else format(x, spec)  # noqa: E731
    print(f"{'mode':8s} {'rows':>6s} {'regen':>6s} {'shipped':>7s} {'tokens':>8s} {'data CPU s':>10s} "
          f"{'budget':>7s} {'steps':>6s} {'sim tau':>7s} | vLLM acceptance / speedup per set")
    missed = [m for m, r in result["modes"].items() if abs(r["over_budget"]) > 0.1]
    for mode, r in result["modes"].items():
        t = r["train"]
        sets = " ".join(f"{s}: {f(d['acceptance_length'])} / {f(d['speedup'])}x" for s, d in r["engine"].items())
        print(f"{mode:8s} {r['rows']:6d} {r['rows_regenerated']:6d} {r['rows_shipped']:7d} "
              f"{f(r['dump']['tokens'], 'd'):>8s} {r['data_cpu_s']:10.1f} {r['budget_cpu_s']:7.0f} "
              f"{t['optimizer_steps']:6d} {f(t['sim_after']['sim_tau']):>7s} | {sets}")
    if missed:
        print(f"not equal CPU time: {', '.join(missed)} spent over 10 % more or less than the budget (the calibration "
              "missed: a larger --calibrate, a quieter host)")
    if result["ngram"]:
        print("ngram (vLLM's prompt lookup, no training): " + " ".join(
            f"{s}: {f(d['acceptance_length'])} / {f(d['speedup'])}x" for s, d in result["ngram"].items()))
    for warning in (result.get("engine_report") or {}).get("warnings", []):
        print(f"warning: {warning}")
    load = result["load"]
    print(f"load avg (1m): min {load['load_1m_min']} mean {load['load_1m_mean']} max {load['load_1m_max']} on "
          f"{load['cpus']} CPUs; total {result['total_s']:.0f} s")


if __name__ == "__main__":
    raise SystemExit(main())

"""Decoding speed before and after, in one run: vanilla tokens/s, prompt-lookup and trained-draft speedups,
and the loop's efficiency (metrics of "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
Trees", §5; the round cost model of "Fast Inference from Transformers via Speculative Decoding", §3.4).

For each target — the toy target, and a deeper locally built Llama (8 layers, d=512, head_dim 64,
trained briefly on the toy chats) — a trained draft comes from ``specdraft.quickstart`` (both cached
under ``--work``). Then, interleaved ``--reps`` times, two measuring processes
(``benchmarks/decoding_worker.py``) decode the same prompts with vanilla, prompt-lookup (PLD), chain
and EAGLE-2 tree decoding: one imports the ``specdraft`` of ``--before`` (a ``git worktree`` of that
commit, made here), the other this tree's. The "after" process also times the model calls a round is
made of, alone: a decode step ``c_1``, a verification forward of n tokens ``c_v(n)``, a draft step
``c_d(q)`` (q queries). From them, the speedup a loop with no overhead would reach at the τ measured:

    chain  τ · c_1 / (γ · c_d(1) + c_v(γ+1))         PLD  τ · c_1 / c_v(γ+1)
    tree   τ · c_1 / (c_d(1) + (depth-1) · c_d(topk) + c_v(total_tokens+1))

and loop efficiency = measured speedup / that prediction (1.0: the loop costs nothing beyond its model
calls). Every generation runs to ``--max-new-tokens`` (EOS ignored, as serving benchmarks do: the
loop's steady state rather than short answers' prefills). Speedups are ratios of total decode time
over the same prompts (greedy: the same tokens), in
wall time and in process CPU time; on a CPU shared with other work the CPU-time ratios are the steady
ones (the machine's load average is recorded around every process).

``--flow`` also runs the ``regenerate-and-train`` flow on ``configs/toy.yaml`` (after only) and reports
its eval stage's time against its train stage's, and the eval stage again on the same draft (before:
the old loop, serial, baselines decoded; after: the floors read from the cache the flow wrote).

``--shape 8b`` is the GPU check: a random-weight Llama of an 8B shape (d=4096, 32 layers, GQA 32/8,
vocab 128256, bf16) and a random draft, in memory (speed only: τ is about 1); it needs CUDA, torch and
transformers only.

    python -m benchmarks.decoding benchmarks/results/decoding_cpu.json --before 444f1a6 --flow
    python -m benchmarks.decoding runs/decoding_8b.json --shape 8b --before <commit>
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.host import write_result

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "decoding_worker.py"
TOY = {}  # the toy target: ToyTargetConfig's defaults
DEEP = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1024, train_steps=300,
            batch_size=16, lr=1.5e-3)  # head_dim 64; trained ~1.5 h on one busy core
SHAPE_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192)


def prepare(work: Path, toy: dict[str, Any], recipe: str, train_samples: int, epochs: int) -> tuple[Path, Path]:
    """A target built with ToyTargetConfig(**toy) and a draft trained on it (reused when ``work`` holds them)."""
    from specdraft.quickstart import run_quickstart
    from specdraft.configs.quickstart import QuickstartConfig
    from specdraft.toy.build import build_toy_target
    from specdraft.configs.toy import ToyTargetConfig

    report = work / "report.json"
    if report.is_file():
        done = json.loads(report.read_text())
        if done.get("recipe") == recipe and Path(done["draft"]).is_dir():
            return Path(done["target"]), Path(done["draft"])
    cfg = ToyTargetConfig(**toy)
    build_toy_target(work / "target", cfg, progress=True, prebuilt=True)  # the shipped toy build when it is that one
    out = run_quickstart(work, QuickstartConfig(toy=cfg, recipe=recipe, num_train=train_samples, num_eval=32,
                                                epochs=epochs), progress=True)
    print(f"{work.name}: draft sim_tau {out['sim_tau_before']} -> {out['sim_tau_after']}", file=sys.stderr)
    return Path(out["target"]), Path(out["draft"])


def toy_prompts(target: Path, n: int) -> list[list[int]]:
    from specdraft.evaluation.questions import render_prompt
    from specdraft.targets.loading import load_tokenizer
    from specdraft.toy.conversations import generate_prompts

    tokenizer = load_tokenizer(target)
    users = [next(m["content"] for m in conv if m["role"] == "user") for conv in generate_prompts(n, 4242)]
    return [render_prompt(tokenizer, [{"role": "user", "content": u}]) for u in users]


def worktree(commit: str, where: Path) -> Path:
    """A detached ``git worktree`` of ``commit`` (the loop before), made once."""
    path = where / f"before-{commit[:12]}"
    if not (path / "specdraft").is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit], check=True,
                       capture_output=True)
    return path


def run_worker(spec: dict[str, Any], code: Path, tmp: Path, name: str) -> dict[str, Any]:
    """One measuring process importing the ``specdraft`` of ``code``."""
    spec_file, out_file = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(code)}
    subprocess.run([sys.executable, str(WORKER), str(spec_file), str(out_file)], check=True, env=env, cwd=str(code))
    return json.loads(out_file.read_text())


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def summarize_runs(runs: list[dict[str, Any]], cfg: dict[str, Any], parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Per decoder: tokens/s, speedups and loop efficiency (medians over the repetitions; a repetition's
    prediction uses the component times measured in the same repetition), and τ."""
    names = list(runs[0]["decoders"])
    out: dict[str, Any] = {}
    for name in names:
        rows = [r["decoders"][name] for r in runs]
        base = [r["decoders"]["vanilla"] for r in runs]
        row = rows[0]
        tau = row["round_tokens"] / row["rounds"] if row["rounds"] and name != "vanilla" else None
        block: dict[str, Any] = {"tokens": row["tokens"], "rounds": row["rounds"], "tau": tau}
        for clock, i in (("wall", 0), ("cpu", 1)):
            speedups = [_ratio(b[f"{clock}_s"], r[f"{clock}_s"]) for r, b in zip(rows, base)]
            block[f"tokens_per_s_{clock}"] = statistics.median(r["tokens"] / r[f"{clock}_s"] for r in rows)
            block[f"speedup_{clock}"] = statistics.median(speedups)
            if tau is not None:
                predicted = [predicted_speedup(name, tau, cfg, p, i) for p in parts]
                block[f"predicted_speedup_{clock}"] = statistics.median(predicted)
                block[f"efficiency_{clock}"] = statistics.median(s / p for s, p in zip(speedups, predicted))
        block["same_tokens_as_vanilla"] = all(r["answers"] == b["answers"] for r, b in zip(rows, base))
        out[name] = block
    return out


def predicted_speedup(name: str, tau: float, cfg: dict[str, Any], parts: dict[str, Any], i: int) -> float:
    """The speedup of a loop that costs only its model calls, at this τ (see the module docstring)."""
    step = parts["step_s"][i]
    verify = lambda n: parts["verify_s"][str(n)][i]  # noqa: E731
    draft = lambda q: parts["draft_s"][str(q)][i]  # noqa: E731
    if name == "pld":
        return tau * step / verify(cfg["gamma"] + 1)
    if name == "chain":
        return tau * step / (cfg["gamma"] * draft(1) + verify(cfg["gamma"] + 1))
    k = cfg["topk"]
    return tau * step / (draft(1) + (cfg["depth"] - 1) * draft(k) + verify(cfg["total_tokens"] + 1))


def measure_target(name: str, spec: dict[str, Any], before: Path | None, reps: int, tmp: Path,
                   cfg: dict[str, Any]) -> dict[str, Any]:
    """Before and after, interleaved (which goes first alternates), on one target; every "after" process
    also times the components, which predict the speedups of its own and the adjacent "before" run."""
    runs: dict[str, list] = {"before": [], "after": []}
    loads = []
    for rep in range(reps):
        order = ["after", "before"] if rep % 2 else ["before", "after"]
        for which in order:
            if which == "before" and before is None:
                continue
            code = ROOT if which == "after" else before
            started = time.perf_counter()
            result = run_worker({**spec, "components": which == "after"}, code, tmp, f"{name}-{which}-{rep}")
            print(f"{name} {which} rep {rep}: {time.perf_counter() - started:.0f} s, load {result['load_before'][0]:.1f}"
                  f" -> {result['load_after'][0]:.1f}", file=sys.stderr, flush=True)
            runs[which].append(result)
            loads.append({"run": f"{which}-{rep}", "load_before": result["load_before"],
                          "load_after": result["load_after"]})
    parts = [r["components"] for r in runs["after"]]
    out = {"components": parts, "load": loads}
    for which, rows in runs.items():
        if rows:
            out[which] = summarize_runs(rows, cfg, parts)
    if runs["before"]:  # the same answers from both loops (greedy)
        out["before_after_same_tokens"] = {
            d: runs["before"][0]["decoders"][d]["answers"] == runs["after"][0]["decoders"][d]["answers"]
            for d in runs["after"][0]["decoders"]}
    for rows in runs.values():  # the answers served their check; the JSON keeps the counts
        for r in rows:
            for d in r["decoders"].values():
                d.pop("answers")
    out["runs"] = runs
    return out


def run_flow(work: Path, before: Path | None, tmp: Path) -> dict[str, Any]:
    """The toy flow's train and eval stage times, and its eval stage again on the same draft, before and after."""
    workdir = work / "flow"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{workdir}/mlflow.db"}
    out = tmp / "flow.json"
    started = time.perf_counter()
    subprocess.run([sys.executable, str(WORKER), "--flow", "configs/toy.yaml", str(workdir), str(out)], check=True,
                   env=env, cwd=str(ROOT))
    result = json.loads(out.read_text())
    flow = {"flow_s": time.perf_counter() - started, "train_s": result["train"]["wall_s"],
            "eval_s": result["eval"]["wall_s"]}
    flow["eval_over_train"] = flow["eval_s"] / flow["train_s"]
    settings = json.loads(Path(result["eval"]["report"]).read_text())["settings"]
    flow["eval_workers"], flow["eval_baselines"] = settings.get("workers"), settings.get("baselines")
    pinned = _stage_epochs("configs/toy.yaml")  # the train section as any loop's config reads it
    for which, code in (("before", before), ("after", ROOT)):
        if code is None:
            continue
        again = tmp / f"eval-again-{which}.json"
        subprocess.run([sys.executable, str(WORKER), "--eval", str(ROOT / "configs/toy.yaml"), settings["target"],
                        result["train"]["draft"], str(workdir / "eval" / f"again-{which}" / "report.json"), str(again),
                        pinned], check=True, env={**env, "PYTHONPATH": str(code)}, cwd=str(code))
        flow[f"eval_again_s_{which}"] = json.loads(again.read_text())["eval_s"]
        flow[f"eval_again_over_train_{which}"] = flow[f"eval_again_s_{which}"] / flow["train_s"]
    return flow


def _stage_epochs(config: str) -> str:
    """``train.epochs=[...]``: the config's epochs, one count per stage of its recipe. An older loop's config
    loader wants them so (it predates one total split over the stages); the eval stage never reads them."""
    from pipelines.configs import RunConfig
    from specdraft.config import load
    epochs = [s.epochs for s in load(RunConfig, ROOT / config).train.resolved()[1]]
    return f"train.epochs=[{','.join(str(e) for e in epochs)}]"


def table(results: dict[str, Any]) -> str:
    """The Markdown table of the run (docs/development.md "Benchmarks" and the report)."""
    lines = ["| target | loop | vanilla tok/s (cpu) | PLD speedup (cpu / wall) | chain speedup | tree speedup "
             "| τ chain / tree / PLD | efficiency chain / tree / PLD (cpu) |", "|" + "---|" * 8]
    for name, res in results["targets"].items():
        for which in ("before", "after"):
            if which not in res:
                continue
            r = res[which]
            fmt = lambda x, p=2: "n/a" if x is None else f"{x:.{p}f}"  # noqa: E731
            lines.append(
                f"| {name} | {which} | {fmt(r['vanilla']['tokens_per_s_cpu'], 0)} "
                f"| {fmt(r['pld']['speedup_cpu'])} / {fmt(r['pld']['speedup_wall'])} "
                f"| {fmt(r['chain']['speedup_cpu'])} / {fmt(r['chain']['speedup_wall'])} "
                f"| {fmt(r['tree']['speedup_cpu'])} / {fmt(r['tree']['speedup_wall'])} "
                f"| {fmt(r['chain']['tau'])} / {fmt(r['tree']['tau'])} / {fmt(r['pld']['tau'])} "
                f"| {fmt(r['chain'].get('efficiency_cpu'))} / {fmt(r['tree'].get('efficiency_cpu'))} "
                f"/ {fmt(r['pld'].get('efficiency_cpu'))} |")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The benchmark's flags."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="JSON output path")
    ap.add_argument("--shape", choices=["toy", "8b"], default="toy",
                    help="toy: the toy and the deep trained targets (CPU); 8b: a random 8B-shaped target (CUDA)")
    ap.add_argument("--targets", default="toy,deep", help="with --shape toy: which of toy, deep")
    ap.add_argument("--before", help="commit whose decoding loop is measured beside this tree's (a git worktree)")
    ap.add_argument("--work", default="runs/bench-decoding", help="models, worktree and scratch directory")
    ap.add_argument("--recipe", default="beagle", help="the trained draft's recipe (specdraft.configs.recipes)")
    ap.add_argument("--train-samples", type=int, default=256, help="draft training conversations")
    ap.add_argument("--epochs", type=int, default=3, help="draft epochs in all (split over the recipe's stages)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--total-tokens", type=int, default=24)
    ap.add_argument("--reps", type=int, default=5, help="interleaved before/after repetitions")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the measuring processes")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="stop generations at EOS (default: run every one to --max-new-tokens, the steady state)")
    ap.add_argument("--flow", action="store_true", help="also time the toy flow's eval stage against its train stage")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)

    work = Path(args.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    cfg = {"gamma": args.gamma, "depth": args.depth, "topk": args.topk, "total_tokens": args.total_tokens}
    decoders = {
        "vanilla": {"max_new_tokens": args.max_new_tokens},
        "pld": {"mode": "chain", "gamma": args.gamma, "max_new_tokens": args.max_new_tokens},
        "chain": {"mode": "chain", "gamma": args.gamma, "max_new_tokens": args.max_new_tokens},
        "tree": {"mode": "tree", "depth": args.depth, "topk": args.topk, "total_tokens": args.total_tokens,
                 "max_new_tokens": args.max_new_tokens},
    }
    common = {"decoders": decoders, "threads": args.threads, "max_new_tokens": args.max_new_tokens,
              "ignore_eos": not args.stop_at_eos,
              "verify_sizes": sorted({args.gamma + 1, args.total_tokens + 1}), "draft_queries": sorted({1, args.topk})}
    before = worktree(args.before, work) if args.before else None
    specs: dict[str, dict[str, Any]] = {}
    if args.shape == "8b":
        import torch

        assert torch.cuda.is_available(), "--shape 8b needs a CUDA device"
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1000, 30000, (256,), generator=g).tolist() for _ in range(args.prompts - 1)]
        prompts.append(([791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679, 13] * 26)[:256])  # repetitive: PLD
        specs["8b"] = {**common, "device": "cuda", "dtype": "bfloat16", "prompts": prompts,
                       "target": {"shape": SHAPE_8B, "seed": 0}, "draft": {"arch": args.recipe if args.recipe in
                                                                            ("beagle", "eagle", "eagle3") else "eagle"}}
    else:
        shapes = {"toy": TOY, "deep": DEEP}
        for name in args.targets.split(","):
            target, draft = prepare(work / name, shapes[name], args.recipe, args.train_samples, args.epochs)
            specs[name] = {**common, "prompts": toy_prompts(target, args.prompts), "target": {"path": str(target)},
                           "draft": {"path": str(draft)}}
    import torch

    results: dict[str, Any] = {
        "benchmark": "decoding",
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "host": {"device": "cuda" if args.shape == "8b" else "cpu", "loadavg_at_start": os.getloadavg(),
                 "gpu": torch.cuda.get_device_name() if args.shape == "8b" else None},
        "before_commit": args.before,
        "targets": {},
    }
    path = Path(args.out)

    def save() -> None:  # after every part: a long run that stops keeps what it measured
        results["table"] = table(results)
        write_result(path, results)

    with tempfile.TemporaryDirectory(dir=work) as tmp:
        for name, spec in specs.items():
            results["targets"][name] = measure_target(name, spec, before, args.reps, Path(tmp), cfg)
            save()
        if args.flow:
            results["flow"] = run_flow(work, before, Path(tmp))
            save()
    print(results["table"])
    if "flow" in results:
        f = results["flow"]
        print(f"toy flow: train {f['train_s']:.0f} s, eval {f['eval_s']:.0f} s ({100 * f['eval_over_train']:.0f}% of "
              f"train); eval again: " + ", ".join(f"{w} {f[f'eval_again_s_{w}']:.0f} s" for w in ("before", "after")
                                                   if f"eval_again_s_{w}" in f))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

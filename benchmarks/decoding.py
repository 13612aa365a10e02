"""Decoding speed: vanilla vs chain vs EAGLE-2 tree speculative decoding (metrics of "EAGLE-2: Faster
Inference of Language Models with Dynamic Draft Trees", §5).

Runs the evaluation path (``specdraft.decoding.eval.run_eval``) on toy-target prompts twice — chain
drafting and the dynamic tree — each time against vanilla greedy decoding of the same prompts, and
writes τ, α_i, tokens/s, vanilla tokens/s, speedup and the lossless check to a JSON file.

Without ``--target/--draft`` it first runs a small quickstart (``specdraft.quickstart``): a toy
target trained briefly plus a briefly trained draft, cached under ``--work``.

    python -m benchmarks.decoding runs/bench/decoding.json [--threads 1] [--prompts 8]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from benchmarks.toy_data import write_toy_questions
from specdraft.decoding import DecodeConfig
from specdraft.decoding.eval import EvalSettings, run_eval
from specdraft.quickstart import QuickstartConfig, run_quickstart
from specdraft.toy.build import ToyTargetConfig


def prepare_models(work: Path, recipe: str, toy: ToyTargetConfig, train_samples: int, epochs: int) -> tuple[Path, Path]:
    """A toy target and a briefly trained draft (reused when ``work`` already holds them)."""
    report = work / "report.json"
    if report.is_file():
        done = json.loads(report.read_text())
        if done.get("recipe") == recipe and Path(done["draft"]).is_dir():
            return Path(done["target"]), Path(done["draft"])
    cfg = QuickstartConfig(toy=toy, recipe=recipe, num_train=train_samples, num_eval=32, epochs=epochs)
    out = run_quickstart(work, cfg, progress=True)
    print(f"quickstart: sim_tau {out['sim_tau_before']} -> {out['sim_tau_after']} in {out['total_seconds']} s",
          file=sys.stderr)
    return Path(out["target"]), Path(out["draft"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="JSON output path")
    ap.add_argument("--target", help="target directory (default: quickstart toy target)")
    ap.add_argument("--draft", help="draft directory (default: quickstart draft)")
    ap.add_argument("--work", default="runs/bench-decoding", help="quickstart cache directory")
    ap.add_argument("--recipe", default="beagle", help="the quickstart draft's recipe (specdraft.recipes)")
    ap.add_argument("--toy-steps", type=int, default=150, help="toy target training steps")
    ap.add_argument("--toy-batch", type=int, default=16, help="toy target batch size")
    ap.add_argument("--train-samples", type=int, default=256, help="draft training conversations")
    ap.add_argument("--epochs", type=int, default=3, help="draft epochs in all (split over the recipe's stages)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--topk", type=int, default=10)
    ap.add_argument("--total-tokens", type=int, default=60)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.target and args.draft:
        target, draft = Path(args.target), Path(args.draft)
    else:
        toy = ToyTargetConfig(train_steps=args.toy_steps, batch_size=args.toy_batch, num_conversations=4000,
                              num_threads=torch.get_num_threads())
        target, draft = prepare_models(work, args.recipe, toy, args.train_samples, args.epochs)
    questions = write_toy_questions(work / "questions.jsonl", args.prompts, seed=4242, max_turns=1)

    modes = {
        "chain": DecodeConfig(mode="chain", gamma=args.gamma, max_new_tokens=args.max_new_tokens),
        "tree": DecodeConfig(mode="tree", depth=args.depth, topk=args.topk, total_tokens=args.total_tokens,
                             max_new_tokens=args.max_new_tokens),
    }
    results = {}
    for name, decode in modes.items():
        started = time.perf_counter()
        report = run_eval(target, draft, [questions], EvalSettings(decode=decode), progress=False)
        block = report["datasets"]["questions"]
        results[name] = {k: v for k, v in block.items() if k not in ("turns", "first_mismatches")}
        results[name]["draft_s"] = sum(r["draft_s"] for r in report["records"])
        results[name]["verify_s"] = sum(r["verify_s"] for r in report["records"])
        results[name]["run_s"] = time.perf_counter() - started
    vanilla = [results[m]["baseline_tokens_per_s"] for m in modes]
    out = {
        "benchmark": "decoding",
        "target": str(target),
        "draft": str(draft),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "device": "cuda" if torch.cuda.is_available() else "cpu"},
        "vanilla_tokens_per_s": sum(vanilla) / len(vanilla),
        **results,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"vanilla: {out['vanilla_tokens_per_s']:.1f} tokens/s")
    for name in modes:
        r = results[name]
        alpha = [None if a is None else round(a, 2) for a in r["alpha"]]
        print(f"{name:5s}: tau {r['tau']:.2f}  alpha {alpha}  {r['tokens_per_s']:.1f} tokens/s  "
              f"speedup {r['speedup']:.2f}x  lossless {r['lossless_checked'] - r['lossless_mismatches']}"
              f"/{r['lossless_checked']}")
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

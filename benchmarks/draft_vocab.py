"""A draft vocabulary sized to pay (issue 40, Deliver 2): the draft head's size chosen by measurement.

FR-Spec ("Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling", ACL 2025) drafts
over the most frequent tokens only: a smaller head makes a draft step cheaper (c in speedup ≈ τ / (v + K·c)) and
loses the drafts whose token lies outside it. On a target and a feature store dumped with the EAGLE-3 aux layers
(``specdraft dump ... aux_layers=eagle3``, or a ``specdraft run`` workdir to find it in), for each size of
``--sizes`` (default 4096, 8192, 16384, 32768 and ``full``, the target's whole vocabulary; a size at or above the
target's is ``full``):

1. **coverage** — the share of the store's predicted tokens (what the draft is trained to predict, counted as
   ``specdraft.run.feature_plan`` counts them) the ``size`` most frequent ones cover; after serving, the share of
   the target's own answers on the held-out questions (vLLM's greedy output without a draft) they cover: no draft
   of that vocabulary can propose the rest;
2. **training** — ``--recipe`` (default ``beagle3``, the default recipe; ``eagle3`` or ``eagle3-hass`` for
   vLLM's own EAGLE-3 class) for the same ``--steps`` over ``--epochs`` with ``train.draft_vocab_size`` = size
   (``benchmarks.recipe_training``, a spawned process per size, as ``benchmarks.real_model`` trains its recipes);
3. **serving** — every size's draft exported in its vLLM format and served by ONE vLLM process on the held-out
   questions at every K of ``--k`` (``engine.sweep_k``), interleaved K by K (each size, then vLLM's ``ngram``;
   ``benchmarks.speculative.engine_sweep``), after the target alone: acceptance length, tokens/s and speedup per K,
   each drafter's fastest K and its cost model (c, v; the acceptance it would need for 1.3× and for ngram's speed:
   ``specdraft.evaluation.engine_sweep``); our decoder's acceptance on the same prompts at K = ``--our-k`` beside
   vLLM's (the gap; greedy equality).

Only recipes that read the EAGLE-3 features take a draft vocabulary (vLLM serves a reduced head on its EAGLE-3
path only, through ``d2t``); ``hass``/``eagle`` drafts share the target's head. One JSON (``benchmarks.host
.write_result``: the machine, the load sampled throughout) and a table. For real (SmolLM2 on the store of
``specdraft run --config configs/smollm2.yaml``, the 464-step budget of ``real_model_smollm2_464steps_cpu.json``; a
quiet machine, about 1 h 15 min: 5 trainings of ~8 min, 31 engine starts, our decoder on 5 drafts)::

    python -m benchmarks.draft_vocab --target targets/smollm2 --run runs-smollm2 --steps 464 --epochs 16 \\
        --precision bf16 --questions configs/data/mt_bench.jsonl ../shared/data/humaneval.jsonl --max-questions 4 \\
        --out benchmarks/results/draft_vocab_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.host import write_result
from specdraft.limits import LoadSampler
from benchmarks.real_model import (add_inputs, find_store, settings_of, shared_settings, store_facts, target_facts,
                                   write_question_sets)

ROOT = Path(__file__).resolve().parents[1]
SIZES = "4096,8192,16384,32768,full"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_inputs(ap)
    ap.add_argument("--sizes", default=SIZES, help="draft vocabulary sizes, comma-separated (full: the target's)")
    ap.add_argument("--recipe", default="beagle3", help="a recipe reading the EAGLE-3 features (beagle3, eagle3, ...)")
    ap.add_argument("--steps", type=int, default=80, help="optimizer steps per size")
    ap.add_argument("--epochs", type=int, default=2, help="epochs the steps are spread over (>= the recipe's stages)")
    ap.add_argument("--max-tokens", type=int, default=1024, help="padded tokens per batch")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the project's)")
    ap.add_argument("--questions", type=Path, nargs="+", default=[ROOT / "configs" / "data" / "mt_bench.jsonl"])
    ap.add_argument("--max-questions", type=int, default=4, help="questions per file")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                    help="the K each drafter is served at (default: engine.sweep_k)")
    ap.add_argument("--our-k", type=int, default=3, help="K of our decoder's chain beside vLLM's (one of --k)")
    ap.add_argument("--engine-max-len", type=int, default=2048, help="vLLM's context (prompt + answer)")
    ap.add_argument("--engine-only", action="store_true", help="no decode of ours on the engine's prompts")
    ap.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of training")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=Path("runs/bench-draft-vocab"))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "draft_vocab_cpu.json")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    from specdraft.configs.evaluation import EngineSettings
    from specdraft.configs.train import TrainConfig
    from specdraft.config import ConfigError

    args.k = tuple(args.k or EngineSettings().sweep_k)
    if args.our_k not in args.k:
        ap.error(f"--our-k {args.our_k} is not one of --k {list(args.k)}")
    if args.steps < args.epochs:
        ap.error(f"--steps {args.steps} is fewer than --epochs {args.epochs}")
    try:
        TrainConfig(recipe=args.recipe, draft_vocab=True, epochs=args.epochs)
    except ConfigError as err:
        ap.error(f"--recipe {args.recipe}: {err}")
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if bad := [s for s in args.sizes if s != "full" and not (s.isdigit() and int(s) >= 1)]:
        ap.error(f"--sizes: {bad} are neither a positive count nor 'full'")
    return args


def resolve_sizes(sizes: list[str], vocab: int) -> dict[str, int]:
    """``{label: size}`` in the order given, a size at or above the target's ``vocab`` (and ``full``) as ``full``,
    each once."""
    out: dict[str, int] = {}
    for s in sizes:
        size = vocab if s == "full" else min(int(s), vocab)
        out.setdefault("full" if size == vocab else f"v{size}", size)
    return out


def train_coverage(store: Path, vocab: int, sizes: dict[str, int]) -> tuple[dict[str, float], int, Any]:
    """(per label the share of the store's predicted tokens its most frequent ids cover, the tokens counted, the
    counts), counted as ``specdraft.run.feature_plan`` counts them."""
    from specdraft.store import predicted_token_counts
    from specdraft.vocab import coverage, select_vocab

    counts = predicted_token_counts([store], vocab)
    return ({label: round(coverage(counts, select_vocab(counts, size)), 5) for label, size in sizes.items()},
            int(counts.sum()), counts)


def answer_coverage(answers: list[list[int]], counts: Any, sizes: dict[str, int]) -> dict[str, float | None]:
    """Per label the share of the tokens of ``answers`` (the target's own, on the held-out prompts) inside the
    vocabulary of that size chosen from ``counts``."""
    import numpy as np

    from specdraft.vocab import select_vocab

    tokens = np.asarray([t for a in answers for t in a], dtype=np.int64)
    out: dict[str, float | None] = {}
    for label, size in sizes.items():
        kept = np.zeros(counts.shape[0], dtype=bool)
        kept[select_vocab(counts, size).numpy()] = True
        out[label] = round(float(kept[tokens].mean()), 5) if tokens.size else None
    return out


def ours(args: argparse.Namespace, run, engine, target: Path, drafts: dict[str, Path]) -> dict[str, Any]:
    """Per label our decoder's chain of ``--our-k`` on the engine's prompts beside vLLM's (``compare``)."""
    from specdraft.configs.decode import DecodeConfig
    from specdraft.configs.evaluation import EvalSettings
    from specdraft.evaluation.engine_comparison import compare
    from specdraft.evaluation.engine_sweep import sweep_name
    from specdraft.evaluation.models import load_models

    settings = EvalSettings(decode=DecodeConfig(mode="chain", gamma=args.our_k, max_new_tokens=args.max_new_tokens))
    out = {}
    for label, draft in drafts.items():
        print(f"[draft_vocab] our decoder with {label} ...", file=sys.stderr, flush=True)
        report = compare(run, sweep_name(label, args.our_k), load_models(target, draft, settings), settings.decode,
                         engine)
        keep = ("acceptance_length", "tau_ours", "gap", "same_answer_as_ours", "prompts")
        out[label] = {**{k: report["overall"].get(k) for k in keep}, "warnings": report["warnings"]}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch
    from transformers.utils import logging as hf_logging

    from benchmarks.recipe_training import train_in_fresh_process
    from benchmarks.speculative import engine_sweep
    from specdraft.evaluation.engine_sweep import sweep_report
    from specdraft.targets.loading import load_target_config

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    work, target = args.work.resolve(), args.target.resolve()
    store = (args.store or find_store(args.run)).resolve()
    vocab = int(load_target_config(target).get_text_config().vocab_size)
    sizes = resolve_sizes(args.sizes, vocab)
    started, phases, trained, result = time.perf_counter(), {}, {}, {}

    def write(complete: bool) -> None:
        write_result(args.out, {
            "benchmark": "draft_vocab", "complete": complete, "note": args.note, "settings": settings_of(args),
            "target": target_facts(target), "store": store_facts(store), "sizes": sizes, **result,
            "train": trained, "phases": phases, "total_s": round(time.perf_counter() - started, 1)},
            load=load.summary(), torch_threads=args.threads)

    with LoadSampler() as load:
        files = write_question_sets(args.questions, work / "questions", args.max_questions)
        result["coverage_train"], result["counted_tokens"], counts = train_coverage(store, vocab, sizes)
        shared = shared_settings(args)
        t0 = time.perf_counter()
        for label, size in sizes.items():
            out = work / "drafts" / label
            shutil.rmtree(out, ignore_errors=True)  # a fresh run: feature_plan would reuse a draft_vocab.json
            print(f"[draft_vocab] training {args.recipe} with a draft vocabulary of {size} ...", file=sys.stderr,
                  flush=True)
            trained[label] = train_in_fresh_process({**shared, "draft_vocab": size}, args.recipe, store, target, out)
            write(False)
        phases["train_s"] = round(time.perf_counter() - t0, 1)
        drafts = {label: Path(t["draft"]) for label, t in trained.items()}
        t0 = time.perf_counter()
        run, ks, engine = engine_sweep(target, drafts, files, work, args.k, args.our_k, args.max_new_tokens,
                                       args.engine_max_len, tag="draft_vocab")
        phases["engine_s"] = round(time.perf_counter() - t0, 1)
        result["coverage_answers"] = answer_coverage(run.vanilla, counts, sizes)
        result["engine"] = {"engine": run.engine, "prompts": len(run.prompts), **sweep_report(run, ks, greedy=True)}
        write(False)
        if not args.engine_only:
            t0 = time.perf_counter()
            result["ours"] = ours(args, run, engine, target, drafts)
            phases["ours_s"] = round(time.perf_counter() - t0, 1)
    write(True)
    print_table(args, sizes, result, trained, load.summary())
    print(f"written: {args.out}")
    return 0


def print_table(args: argparse.Namespace, sizes: dict[str, int], result: dict[str, Any], trained: dict[str, Any],
                load: dict[str, Any]) -> None:
    """One line per size: coverage, training, vLLM's acceptance and speedup per K, its best K and cost; ngram last."""
    f = lambda x, spec=".2f": "-" if x is None else format(x, spec)  # noqa: E731
    sweep, ours_ = result["engine"], result.get("ours") or {}
    head = (f"{'vocab':>7s} {'cov train':>9s} {'cov ans':>7s} {'sim tau':>7s} "
            + "".join(f" | K={k} {'AL':>5s} {'x':>5s}" for k in sweep["k"])
            + f" | {'best':>6s} {'c':>6s} {'v':>5s} | ours K={args.our_k} {'gap':>6s}")
    print(head)
    print("-" * len(head))
    for label, size in [*sizes.items(), ("ngram", None)]:
        rows = sweep[label]
        cells = "".join(f" |   {f((rows.get(str(k)) or {}).get('acceptance_length')):>7s} "
                        f"{f((rows.get(str(k)) or {}).get('speedup')):>5s}" for k in sweep["k"])
        cost = sweep["cost"][label]
        best = f"K={sweep['best_k'][label]} {f(sweep['best_speedup'][label])}x"
        mine = ours_.get(label) or {}
        line = (f"{size if size else label:>7} {f(result['coverage_train'].get(label), '.4f'):>9s} "
                f"{f(result['coverage_answers'].get(label), '.4f'):>7s} "
                f"{f((trained.get(label) or {}).get('sim_after', {}).get('sim_tau')):>7s}{cells} | {best:>6s} "
                f"{f(cost['c'], '.3f'):>6s} {f(cost['v']):>5s} | {f(mine.get('tau_ours')):>11s} "
                f"{f(None if mine.get('gap') is None else 100 * mine['gap'], '+.1f'):>6s}")
        print(line)
    print("cov train: share of the store's predicted tokens in the vocabulary; cov ans: of the target's own answers to "
          "the held-out questions; AL: vLLM's mean acceptance length; x: its tokens/s over the target alone; c, v: "
          "the cost model's draft step and verify step in target steps; ours: our decoder's chain τ on the same prompts "
          "and its gap to vLLM's (%)")
    print(f"load avg (1m): min {load['load_1m_min']} mean {load['load_1m_mean']} max {load['load_1m_max']} on "
          f"{load['cpus']} CPUs; vanilla {f(result['engine']['tokens_per_s_vanilla'], '.1f')} tokens/s")


if __name__ == "__main__":
    raise SystemExit(main())

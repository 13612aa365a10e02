"""Speculative decoding of the toy target with a trained draft, as the training benchmarks measure it.

Greedy chain drafting and the dynamic draft tree of "EAGLE-2: Faster Inference of Language Models with
Dynamic Draft Trees" (§4), each against vanilla greedy decoding of the same questions
(``specdraft.evaluation.run.run_eval``): tau (tokens per target forward, bonus token counted), alpha_i,
speedup and the lossless check, with a bootstrap interval of tau over the questions.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def bootstrap_tau(records: list[dict[str, Any]], samples: int = 2000, seed: int = 0) -> list[float] | None:
    """95% interval of tau = sum(round_tokens) / sum(rounds), questions resampled with replacement."""
    per_question: dict[int, list[int]] = {}
    for r in records:
        acc = per_question.setdefault(r["index"], [0, 0])
        acc[0] += r["round_tokens"]
        acc[1] += r["rounds"]
    if not per_question:
        return None
    totals = np.array(list(per_question.values()), dtype=np.float64)  # (Q, 2)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(totals), size=(samples, len(totals)))  # (samples, Q)
    sums = totals[picks].sum(axis=1)  # (samples, 2)
    taus = sums[:, 0] / np.maximum(sums[:, 1], 1)
    return [round(float(x), 3) for x in np.percentile(taus, [2.5, 97.5])]


def decode_eval(target: Path, draft: Path, files: list[Path], args: argparse.Namespace,
                modes: dict[str, Any] | None = None, baselines: Path | None = None) -> dict[str, Any]:
    """Greedy speculative decoding of every question file; per dataset and mode. ``modes``: name ->
    ``DecodeConfig`` (default: ``chain`` of ``args.gamma`` and the ``tree`` of ``args``); ``baselines``: a
    directory where the vanilla and prompt-lookup decodes are cached (``run_eval``'s), shared between drafts."""
    from specdraft.configs.decode import DecodeConfig
    from specdraft.configs.evaluation import EvalSettings
    from specdraft.evaluation.run import run_eval

    modes = modes or {
        "chain": DecodeConfig(mode="chain", gamma=args.gamma, max_new_tokens=args.max_new_tokens),
        "tree": DecodeConfig(mode="tree", depth=args.tree_depth, topk=args.tree_topk, total_tokens=args.total_tokens,
                             max_new_tokens=args.max_new_tokens),
    }
    out: dict[str, Any] = {}
    for mode, decode in modes.items():
        started = time.perf_counter()
        settings = EvalSettings(decode=decode, device="cpu", seed=args.seed,
                                workers=getattr(args, "eval_workers", None))  # None: one per CPU core
        report = run_eval(target, draft, files, settings, progress=False, baselines_home=baselines)
        for name, block in report["datasets"].items():
            entry = {k: v for k, v in block.items() if k != "turns"}
            entry["tau_per_turn"] = {t: b["tau"] for t, b in block["turns"].items()}
            entry["tau_ci95"] = bootstrap_tau([r for r in report["records"] if r["dataset"] == name], seed=args.seed)
            out.setdefault(name, {})[mode] = entry
        for name in report["datasets"]:
            out[name][mode]["eval_run_s"] = round(time.perf_counter() - started, 2)
    return out



ENGINE_KEYS = ("engine", "speculative_tokens", "prompts", "engine_process_s", "warnings")  # engine_acceptance's own


def engine_acceptance(target: Path, drafts: dict[str, Path], files: list[Path], work: Path, max_new_tokens: int,
                      k: int, floor: bool = False, max_model_len: int | None = 512,
                      ours: bool = True, served: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """vLLM's acceptance of each draft beside our decoder's (``specdraft.evaluation.engine``): every draft exported in
    its vLLM format and served from one vLLM process (the target alone, then with each draft, on the questions),
    our decoder a chain of ``k`` on the same prompts counted as vLLM counts; per recipe the overall report of
    ``evaluation.engine_comparison.compare`` (acceptance length on both sides, the gap, per-position rates, greedy
    equality) and its per-dataset reports. ``floor``: vLLM's own ``ngram`` prompt lookup served too (under
    ``"ngram"``: the engine's numbers alone); ``ours=False``: the engine's numbers alone for the drafts as well (no
    decode of ours); ``max_model_len`` None: the target's positions. ``served``: drafts already in a format vLLM
    reads (name -> an ``EngineRequest.drafts`` entry, e.g. a draft trained by the peer ``speculators``), served on
    the same prompts in the same process, the engine's numbers alone."""
    from dataclasses import asdict

    from specdraft.configs.decode import DecodeConfig
    from specdraft.configs.evaluation import EngineSettings, EvalSettings
    from specdraft.export import VLLM_FORMATS, export_draft, export_layout, formats_for
    from specdraft.models import read_draft_config
    from specdraft.evaluation.engine import measure_engine, ngram_drafter
    from specdraft.evaluation.engine_comparison import compare, engine_only
    from specdraft.evaluation.engine_records import EngineRequest, vanilla_timing, vanilla_warnings
    from specdraft.evaluation.models import load_models
    from specdraft.evaluation.questions import load_question_sets

    exports = {}
    for recipe, draft in drafts.items():
        fmt = next(f for f in formats_for(read_draft_config(draft)) if f in VLLM_FORMATS)
        out = export_draft(draft, fmt, work / "export" / recipe, target=target, speculative_tokens=k, overwrite=True)
        exports[recipe] = {"model": str(out), "method": export_layout(fmt, out).method}
    engine_drafters = {**(served or {}), **({"ngram": ngram_drafter()} if floor else {})}  # the engine's numbers alone
    exports.update(engine_drafters)
    engine = EngineSettings(name="vllm", speculative_tokens=k, max_model_len=max_model_len)
    started = time.perf_counter()
    run = measure_engine(EngineRequest(target=str(target), drafts=exports, questions=load_question_sets(files),
                                       settings=asdict(engine), max_new_tokens=max_new_tokens), engine)
    result: dict[str, Any] = {"engine": run.engine, "speculative_tokens": k, "prompts": len(run.prompts),
                              "engine_process_s": round(time.perf_counter() - started, 1),
                              # vanilla's two passes disagreeing: every speedup below is that uncertain
                              "warnings": vanilla_warnings(vanilla_timing(run), len(run.turns),
                                                           engine.vanilla_drift_warn, greedy=True)}
    for line in result["warnings"]:
        print(f"[engine] warning: {line}", file=sys.stderr, flush=True)
    settings = EvalSettings(decode=DecodeConfig(mode="chain", gamma=k, max_new_tokens=max_new_tokens))
    for recipe, draft in drafts.items():
        if ours:
            report = compare(run, recipe, load_models(target, draft, settings), settings.decode, engine)
        else:
            report = {**engine_only(run, recipe, k), "warnings": []}
        result[recipe] = {**report["overall"], "warnings": report["warnings"], "datasets": report["datasets"]}
    for name, spec in engine_drafters.items():
        report = engine_only(run, name, k)
        result[name] = {**report["overall"], "datasets": report["datasets"], "drafter": spec}
    return result


def engine_sweep(target: Path, drafts: dict[str, Path], files: list[Path], work: Path, ks: tuple[int, ...],
                 speculative_tokens: int, max_new_tokens: int, max_model_len: int | None,
                 served: dict[str, dict[str, Any]] | None = None, tag: str = "bench"):
    """Every draft (exported in its vLLM format under ``work/export``), every ``served`` entry (a draft already in a
    format vLLM reads: the peer's) and vLLM's ngram in ONE vLLM process at every K of ``ks``, interleaved K by K,
    after the target alone, on the question ``files`` (``benchmarks/draft_vocab.py``, ``benchmarks/data_scaling.py``);
    (the ``EngineRun``, the K per drafter, the engine settings) — ``specdraft.evaluation.engine_sweep.sweep_report``
    reads them. vLLM's own log: ``work/engine.log``."""
    import sys
    from dataclasses import asdict

    from specdraft.configs.evaluation import EngineSettings
    from specdraft.evaluation.engine import measure_engine, ngram_drafter, sweep_ks
    from specdraft.evaluation.engine_records import EngineRequest
    from specdraft.evaluation.engine_sweep import sweep_name
    from specdraft.evaluation.questions import load_question_sets
    from specdraft.export import VLLM_FORMATS, export_draft, export_layout, formats_for
    from specdraft.models import read_draft_config

    engine = EngineSettings(name="vllm", speculative_tokens=speculative_tokens, sweep_k=tuple(ks),
                            max_model_len=max_model_len, timeout_s=4 * 3600.0)
    entries = dict(served or {})
    for label, draft in drafts.items():
        fmt = next(f for f in formats_for(read_draft_config(draft)) if f in VLLM_FORMATS)
        out = export_draft(draft, fmt, work / "export" / label, target=target, speculative_tokens=speculative_tokens,
                           overwrite=True)
        entries[label] = {"model": str(out), "method": export_layout(fmt, out).method}
    ks_of = {**{label: sweep_ks(engine)["draft"] for label in entries}, "ngram": list(engine.measured_k)}
    entries["ngram"] = ngram_drafter()
    requests = {sweep_name(label, k): {**entries[label], "num_speculative_tokens": k}
                for k in engine.measured_k for label in ks_of if k in ks_of[label]}  # interleaved: K by K
    log = work / "engine.log"
    print(f"[{tag}] vLLM: {len(requests)} drafter x K after the target alone; its log: {log}", file=sys.stderr,
          flush=True)
    run = measure_engine(EngineRequest(target=str(target), drafts=requests, questions=load_question_sets(files),
                                       settings=asdict(engine), max_new_tokens=max_new_tokens), engine, log)
    return run, ks_of, engine

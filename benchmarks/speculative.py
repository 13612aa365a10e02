"""Speculative decoding of the toy target with a trained draft, as the training benchmarks measure it.

Greedy chain drafting and the dynamic draft tree of "EAGLE-2: Faster Inference of Language Models with
Dynamic Draft Trees" (§4), each against vanilla greedy decoding of the same questions
(``specdraft.decoding.eval.run_eval``): tau (tokens per target forward, bonus token counted), alpha_i,
speedup and the lossless check, with a bootstrap interval of tau over the questions.
"""

from __future__ import annotations

import argparse
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


def decode_eval(target: Path, draft: Path, files: list[Path], args: argparse.Namespace) -> dict[str, Any]:
    """Greedy chain and tree speculative decoding of every question file; per dataset and mode."""
    from specdraft.decoding import DecodeConfig
    from specdraft.decoding.eval import EvalSettings, run_eval

    modes = {
        "chain": DecodeConfig(mode="chain", gamma=args.gamma, max_new_tokens=args.max_new_tokens),
        "tree": DecodeConfig(mode="tree", depth=args.tree_depth, topk=args.tree_topk, total_tokens=args.total_tokens,
                             max_new_tokens=args.max_new_tokens),
    }
    out: dict[str, Any] = {}
    for mode, decode in modes.items():
        started = time.perf_counter()
        report = run_eval(target, draft, files, EvalSettings(decode=decode, device="cpu", seed=args.seed),
                          progress=False)
        for name, block in report["datasets"].items():
            entry = {k: v for k, v in block.items() if k != "turns"}
            entry["tau_per_turn"] = {t: b["tau"] for t, b in block["turns"].items()}
            entry["tau_ci95"] = bootstrap_tau([r for r in report["records"] if r["dataset"] == name], seed=args.seed)
            out.setdefault(name, {})[mode] = entry
        for name in report["datasets"]:
            out[name][mode]["eval_run_s"] = round(time.perf_counter() - started, 2)
    return out


def engine_acceptance(target: Path, drafts: dict[str, tuple[Path, int]], files: list[Path], work: Path,
                      max_new_tokens: int) -> dict[str, Any]:
    """vLLM's acceptance of each exported draft beside our decoder's, on the questions' first turns.

    ``drafts``: recipe -> (draft directory, K drafted tokens per step). Each draft is exported in vLLM's
    speculators format (``specdraft.export``) and served by a real vLLM engine (all engines in one child
    process, ``specdraft.serving.vllm_engine``), greedy, decoding every prompt to ``max_new_tokens`` with the
    EOS stop off; our decoder runs the same prompts with the same K and no EOS stop. Reported per recipe: the
    mean acceptance length of both (1 + accepted / drafts), their relative gap, vLLM's counters, and whether
    vLLM's tokens equal the target's greedy tokens (our vanilla decoding)."""
    from specdraft.decoding import DecodeConfig, ModelDrafter, speculative_decode, vanilla_generate
    from specdraft.decoding.block import BlockDrafter
    from specdraft.decoding.eval import load_question_sets, render_prompt
    from specdraft.export import export_draft
    from specdraft.models import load_draft
    from specdraft.serving.vllm_engine import EngineJob, run_engines
    from specdraft.target import load_target_model, load_tokenizer

    tokenizer, model = load_tokenizer(target), load_target_model(target)
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": q["turns"][0]}])
               for q in load_question_sets(files)]
    jobs, names = [], []
    for recipe, (draft_dir, k) in drafts.items():
        out = export_draft(draft_dir, "speculators", work / "export" / recipe, target=target, speculative_tokens=k,
                           overwrite=True)
        method = "dflash" if recipe.endswith("dflash") else "eagle3"
        jobs.append(EngineJob(target=str(target), prompts=prompts, max_new_tokens=max_new_tokens,
                              speculative={"method": method, "model": str(out), "num_speculative_tokens": k}))
        names.append(recipe)
    started = time.perf_counter()
    served = run_engines(jobs)
    engine_s = round(time.perf_counter() - started, 1)
    cfg = DecodeConfig(mode="chain", max_new_tokens=max_new_tokens)
    greedy = [vanilla_generate(model, p, cfg).tokens for p in prompts]
    result: dict[str, Any] = {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "engine_process_s": engine_s,
                              "note": "greedy, EOS stop off in both; acceptance length = 1 + accepted / drafts"}
    for recipe, engine in zip(names, served):
        draft_dir, k = drafts[recipe]
        draft = load_draft(draft_dir, target=target)
        chain = DecodeConfig(mode="chain", gamma=k, max_new_tokens=max_new_tokens)
        drafter = (BlockDrafter(draft, k, chain.sampling) if draft.config.drafts_blocks
                   else ModelDrafter(draft, chain))
        rounds = accepted = 0
        for p in prompts:
            gen = speculative_decode(model, drafter, p, chain)
            rounds, accepted = rounds + gen.rounds, accepted + sum(gen.accepted)
        ours = 1 + accepted / max(1, rounds)
        theirs = engine["acceptance_length"]
        result[recipe] = {
            "speculative_tokens": k, "vllm_acceptance_length": theirs, "ours_acceptance_length": round(ours, 4),
            "relative_gap": None if theirs is None else round(abs(theirs - ours) / ours, 4),
            "vllm_drafts": engine["drafts"], "vllm_accepted": engine["accepted"], "ours_rounds": rounds,
            "ours_accepted": accepted, "vllm_equals_target_greedy": engine["tokens"] == greedy,
        }
    return result

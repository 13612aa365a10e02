"""Our decoder on the engine's prompts, counted as the engine counts, beside the engine's counters: the
engine measurement's comparison ("EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" §5
defines the acceptance length; vLLM's mean acceptance length = 1 + accepted / drafts, SGLang's τ).

Counting: vLLM compares all K drafts of a round with the target before it applies the stop token, so a
drafted token after EOS that matches still counts as accepted. ``compare`` counts our decoder the same way:
it decodes each prompt with the EOS stop off and ``max_new_tokens`` = the engine's answer length (EOS
included), which leaves every round as it was and the last one uncut.

``engine_only`` reports the engine's side alone, for a drafter of the engine's own with no model of ours (vLLM's
``ngram`` prompt lookup, ``engine.ngram_drafter``: the floor in the engine).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from specdraft.decoding.speculative import speculative_generate
from specdraft.configs.decode import DecodeConfig
from specdraft.evaluation.engine_records import VANILLA_KEYS, EngineRun, vanilla_timing
from specdraft.evaluation.models import Models
from specdraft.placement import output_device
from specdraft.progress import ProgressLines
from specdraft.configs.evaluation import EngineSettings


def compare(run: EngineRun, name: str, models: Models, decode: DecodeConfig, engine: EngineSettings,
            progress: bool = False) -> dict[str, Any]:
    """Our decoder (chain of K, the eval's sampling settings) on the engine's prompts, counted as vLLM counts,
    beside the engine's counters for the draft ``name``: acceptance length, accepted per position, tokens/s,
    per dataset and overall.

    ``models``: ``models.Models`` of the same target and draft; ``decode``: the eval's ``DecodeConfig``;
    ``progress``: progress lines (``specdraft.progress``) over the prompts."""
    k = engine.speculative_tokens
    greedy = decode.temperature == 0
    device = output_device(models.target)
    spec = run.spec[name]
    ours: dict[str, dict[str, Any]] = {}
    lines = ProgressLines("engine: ours on its prompts", len(run.prompts), "prompts", enabled=progress)
    for i, (prompt, turn) in enumerate(zip(run.prompts, run.turns)):
        if greedy:  # vLLM's count: every round as it was, the last one uncut by the stop token
            cfg = replace(decode, mode="chain", gamma=k, max_new_tokens=max(1, len(spec[i])))
            eos = frozenset()
        else:
            cfg, eos = replace(decode, mode="chain", gamma=k), models.eos_ids
        gen = speculative_generate(models.target, models.draft, prompt, cfg, eos,
                                   torch.Generator(device=device).manual_seed(i))
        row = ours.setdefault(turn["dataset"], {"rounds": 0, "accepted": 0, "per_pos": [0] * k, "tokens": 0,
                                               "wall_s": 0.0, "prompts": 0, "same_answer": 0})
        row["rounds"] += gen.rounds
        row["accepted"] += sum(gen.accepted)
        row["per_pos"] = [a + b for a, b in zip(row["per_pos"], gen.depth_accepted)]
        row["tokens"] += len(gen.tokens)
        row["wall_s"] += gen.wall_s
        row["prompts"] += 1
        row["same_answer"] += int(gen.tokens == spec[i])
        lines.update(1, len(gen.tokens))
    datasets = {dataset: _dataset_report(run, name, [dataset], row, k, greedy) for dataset, row in ours.items()}
    overall = _dataset_report(run, name, list(ours), _total(ours.values(), k), k, greedy)
    warnings = [f"{dataset}: the engine's acceptance length {d['acceptance_length']:.3f} differs from ours "
                f"{d['tau_ours']:.3f} by {100 * d['gap']:+.1f}% (more than {100 * engine.max_gap:.0f}%)"
                for dataset, d in {**datasets, "overall": overall}.items()
                if d["gap"] is not None and abs(d["gap"]) > engine.max_gap]
    return {"engine": run.engine, "speculative_tokens": k, "greedy": greedy, "datasets": datasets, "overall": overall,
            "warnings": warnings}


def engine_only(run: EngineRun, name: str, k: int, greedy: bool = True) -> dict[str, Any]:
    """The engine's counters for the drafter ``name`` alone (no decoder of ours to put beside them): per dataset
    and overall its acceptance length, accepted per position, tokens/s with and without it, the engine's speedup
    and (greedy) how many answers equal the engine's answers without it."""
    datasets = list(dict.fromkeys(t["dataset"] for t in run.turns))
    report = {dataset: _engine_side(run, name, [dataset], k, greedy) for dataset in datasets}
    return {"engine": run.engine, "speculative_tokens": k, "greedy": greedy, "datasets": report,
            "overall": _engine_side(run, name, datasets, k, greedy)}


def _total(rows, k: int) -> dict[str, Any]:
    rows = list(rows)
    out = {key: sum(r[key] for r in rows) for key in ("rounds", "accepted", "tokens", "wall_s", "prompts", "same_answer")}
    out["per_pos"] = [sum(r["per_pos"][j] for r in rows) for j in range(k)]
    return out


def _engine_side(run: EngineRun, draft: str, names: list[str], k: int, greedy: bool) -> dict[str, Any]:
    """The engine's own numbers for ``draft`` over the datasets ``names``: its counters and its timings."""
    counted = run.counters[draft]
    counters = {key: sum(counted[n].get(key, 0) for n in names)
                for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    per_pos = [sum((counted[n].get("num_accepted_tokens_per_pos") or [0] * k)[j] for n in names) for j in range(k)]
    rows = [i for i, t in enumerate(run.turns) if t["dataset"] in names]
    spec = run.spec[draft]
    spec_tokens = sum(len(spec[i]) for i in rows)
    spec_s = sum(run.spec_s[draft][n] for n in names)
    drafts = counters["num_drafts"]
    loads = [x for n in names for x in run.load_1m.get(draft, {}).get(n, [])]
    spec_tps = spec_tokens / spec_s if spec_s else None
    vanilla = vanilla_timing(run, names)  # both passes combined, when it ran twice
    vanilla_tps = vanilla["tokens_per_s_vanilla"]
    return {
        "acceptance_length": 1 + counters["num_accepted_tokens"] / drafts if drafts else None,  # 1 + accepted / drafts
        "accepted_per_pos": [a / drafts for a in per_pos] if drafts else [],  # P(position j accepted) per round
        "drafts": drafts,
        "prompts": len(rows),
        "engine_lossless": sum(spec[i] == run.vanilla[i] for i in rows) if greedy else None,
        "tokens_per_s": spec_tps,  # the engine with the draft
        "speedup": spec_tps / vanilla_tps if spec_tps and vanilla_tps else None,  # the engine's own speedup
        "load_1m": sum(loads) / len(loads) if loads else None,  # the 1-minute load average while it was timed
        # the engine without it: its tokens/s (both passes combined) and load, each pass's, their drift
        **vanilla,
    }


def _dataset_report(run: EngineRun, draft: str, names: list[str], ours: dict[str, Any], k: int,
                    greedy: bool) -> dict[str, Any]:
    engine = _engine_side(run, draft, names, k, greedy)
    length = engine["acceptance_length"]
    tau_ours = 1 + ours["accepted"] / ours["rounds"] if ours["rounds"] else None
    return {
        "acceptance_length": length,  # vLLM: 1 + accepted / drafts
        "tau_ours": tau_ours,  # ours, counted the same way (chain of K on the same prompts)
        "gap": (length - tau_ours) / tau_ours if length is not None and tau_ours else None,
        "accepted_per_pos": engine["accepted_per_pos"],  # P(position j accepted) per round
        "accepted_per_pos_ours": [a / ours["rounds"] for a in ours["per_pos"]] if ours["rounds"] else [],
        "drafts": engine["drafts"],
        "rounds_ours": ours["rounds"],
        "prompts": engine["prompts"],
        "same_answer_as_ours": ours["same_answer"] if greedy else None,  # greedy: the engine's tokens equal ours
        "engine_lossless": engine["engine_lossless"],
        "tokens_per_s": engine["tokens_per_s"],  # the engine with the draft
        "speedup": engine["speedup"],  # the engine's own speedup
        "load_1m": engine["load_1m"],  # the load while the engine ran with the draft
        # the engine without it: tokens/s (both passes combined) and load, each pass's, drift, answers changed
        **{key: engine[key] for key in VANILLA_KEYS},
        "tokens_per_s_ours": ours["tokens"] / ours["wall_s"] if ours["wall_s"] else None,
    }

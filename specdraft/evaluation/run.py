"""``run_eval``: a draft evaluated against its target on question files, in one call (docs/evaluation.md;
the question format of "Judging LLM-as-a-Judge with MT-Bench and Chatbot
Arena": questions are independent, so they spread over workers).

Questions are loaded and numbered (``questions``), the draft checked against the target, the split decided
(``replicas.plan_workers``: one worker per CPU core or per ``gpus`` GPUs by default), the vanilla / floor cache
opened (``baselines``), every question evaluated (``records``) in this process or in worker processes, and
the records aggregated (``report``). Records are the same whatever the split (timings aside). The Ray path
(``pipelines/evaluate.py``) spreads the same per-question function over Ray actors instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdraft.configs.evaluation import EvalSettings
from specdraft.evaluation.baselines import baselines_dir, open_baselines
from specdraft.evaluation.models import load_models, warmup
from specdraft.evaluation.questions import load_question_sets
from specdraft.evaluation.records import decoded_tokens, evaluate_question
from specdraft.evaluation.replicas import evaluate_in_processes, plan_workers
from specdraft.evaluation.report import build_report, settings_dict
from specdraft.models import check_draft_target
from specdraft.placement import describe_placement
from specdraft.progress import ProgressLines


def run_eval(
    target_dir: str | Path,
    draft_dir: str | Path,
    question_files: list[str | Path],
    settings: EvalSettings = EvalSettings(),
    progress: bool = True,  # progress lines (``specdraft.progress``): questions done, tokens/s, ETA
    report_path: str | Path | None = None,
    baselines_home: str | Path | None = None,
) -> dict[str, Any]:
    """Evaluate every question — in this process, or spread over worker processes (``replicas``) —
    reusing cached baselines (``baselines_dir``); return the report."""
    skipped: list[dict[str, Any]] = []
    kinds: dict[str, dict[str, int]] = {}
    questions = load_question_sets(question_files, settings.max_questions, allow_empty=settings.allow_empty,
                                   skipped=skipped, kinds=kinds)
    check_draft_target(draft_dir, target_dir)
    plan = plan_workers(settings, len(questions))
    cache = open_baselines(baselines_dir(settings, report_path, baselines_home), target_dir, questions, settings,
                           plan.device, plan.workers, plan.threads)
    cached = [cache.for_question(q) for q in questions]
    if progress:  # loading the models and the first question may take minutes: said before they start
        print(f"[specdraft] eval: {len(questions)} questions on {plan.workers} worker(s) ({plan.device.type}), "
              f"loading target + draft", flush=True)
    if plan.workers == 1:
        models = load_models(target_dir, draft_dir, settings)
        if settings.warmup:
            warmup(models, settings)
        records = []
        lines = ProgressLines("eval", len(questions), "questions", enabled=progress)
        for q, c in zip(questions, cached):
            rows = evaluate_question(models, q, settings, c)
            records += rows
            lines.update(1, decoded_tokens(rows))
        placements = [describe_placement(models.target)]
    else:
        records, placements = evaluate_in_processes(target_dir, draft_dir, questions, cached, settings, plan, progress)
    cache.absorb(records)
    extra = {"target": str(target_dir), "draft": str(draft_dir), "questions": [str(f) for f in question_files],
             "placement": placements,  # kernel, dtype, devices actually used
             "workers": plan.describe(), "baselines": cache.summary()}
    return {**build_report(records, settings_dict(settings, **extra)), "questions_skipped": skipped,
            "question_kinds": kinds}

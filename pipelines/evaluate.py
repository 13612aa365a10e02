"""Evaluate stage: acceptance length of a draft against its target, spread over Ray Data replicas.

The metrics are those of "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"
(Li et al., 2024), Section 4 ("Experiments": average acceptance length tau, acceptance rate alpha
per depth, speedup), measured by lossless speculative decoding ("Fast Inference from Transformers
via Speculative Decoding", Leviathan et al., 2023, Section 2), beside the prompt-lookup floor
(docs/evaluation.md).

    questions (driver)   MT-Bench-format files -> globally numbered questions
                         (``specdraft.evaluation.questions.load_question_sets``)
    -> map_batches       one stateful replica per model copy (Ray Data actors: ``settings.gpus``
                         GPUs each on a GPU cluster — the target spread over them, the draft on
                         the last —; ``num_cpus`` each locally); each loads target + draft once,
                         warms up, and answers one question per call with its per-turn records (JSON:
                         vanilla, the draft, and the prompt-lookup floor unless
                         ``settings.pld.enabled`` is off)
    -> driver            records sorted by (question, turn) -> ``build_report``, the same
                         report as the single-process path (which spreads questions over local
                         processes instead: ``specdraft.evaluation.replicas``)

Both paths decode and time vanilla and the prompt-lookup floor beside the draft, turn by turn, and compare
their tokens and counts with the cache of ``specdraft.evaluation.baselines`` when another draft was evaluated on
the same questions before (the driver passes each question's cached turns to the replica, and writes what the
replicas carried back: tokens and counts, never times).

The speculative decoding itself lives in ``specdraft.decoding``, the per-question evaluation in
``specdraft.evaluation``; this module only spreads questions over replicas. Records depend only on
(settings, question), never on which replica ran it — sampling seeds come from (seed, question index,
turn) — so the Ray path and the single-process path give identical reports, timings aside.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray
import torch

from pipelines.cluster import ACTOR_POOL, connect_ray
from pipelines.configs import RayEvalConfig
from pipelines.nodes import by_node, this_node
from specdraft.config import ConfigError, from_dict, to_dict
from specdraft.configs.evaluation import EvalSettings
from specdraft.evaluation.baselines import baselines_dir, open_baselines
from specdraft.evaluation.engine import engine_report
from specdraft.evaluation.models import load_models, warmup
from specdraft.evaluation.questions import load_question_sets
from specdraft.evaluation.records import decoded_tokens, evaluate_question
from specdraft.evaluation.report import build_report, settings_dict, write_report
from specdraft.evaluation.run import run_eval
from specdraft.models import check_draft_target
from specdraft.placement import describe_placement
from specdraft.progress import ProgressLines


class EvalReplica:
    """One target + draft copy (a Ray Data actor): evaluates one question per call."""

    def __init__(self, target: str, draft: str, settings: dict[str, Any], use_gpu: bool, num_cpus: float):
        self.settings = from_dict(EvalSettings, settings)
        if self.settings.device == "auto":  # a CPU cluster: one device, whatever gpus says
            placed = {"device": "cuda", "gpus": self.settings.gpus} if use_gpu else {"device": "cpu", "gpus": 1}
            self.settings = from_dict(EvalSettings, {**settings, **placed})
        if not use_gpu:
            torch.set_num_threads(max(1, round(num_cpus)))
        self.models = load_models(target, draft, self.settings)  # over the replica's settings.gpus GPUs
        self.placement = json.dumps(describe_placement(self.models.target))
        self.node = this_node()  # the report's placement: which node answered which questions
        if self.settings.warmup:
            warmup(self.models, self.settings)

    def __call__(self, batch: pa.Table) -> pa.Table:
        out = []
        for row in batch.to_pylist():
            records = evaluate_question(self.models, json.loads(row["question"]), self.settings,
                                        json.loads(row["cached"]))
            out.append({"index": row["index"], "records": json.dumps(records), "placement": self.placement,
                        **self.node})
        return pa.Table.from_pylist(out, schema=REPLICA_SCHEMA)


REPLICA_SCHEMA = pa.schema([("index", pa.int64()), ("records", pa.string()), ("placement", pa.string()),
                            ("node", pa.string()), ("ip", pa.string())])


def _replicas(cfg: RayEvalConfig, settings: EvalSettings, use_gpu: bool, questions: int) -> int:
    if cfg.replicas is not None:
        n = cfg.replicas
    else:
        resources = ray.cluster_resources()
        n = int(resources.get("GPU", 0) // settings.gpus) if use_gpu else int(resources.get("CPU", 1) // cfg.num_cpus)
    return max(1, min(n, questions))


def evaluate_with_ray(
    target: str | Path,
    draft: str | Path,
    question_files: list[str | Path],
    settings: EvalSettings = EvalSettings(),
    cfg: RayEvalConfig = RayEvalConfig(),
    progress: bool = True,
    baselines: Path | None = None,
) -> dict[str, Any]:
    """The report of ``run_eval``, computed by Ray Data actors (one question per task), comparing with and
    filling the same vanilla / floor cache (``baselines``: its directory, None: off).

    The draft is checked against the target on the driver (``check_draft_target``), before Ray starts."""
    skipped: list[dict[str, Any]] = []
    kinds: dict[str, dict[str, int]] = {}
    questions = load_question_sets(question_files, settings.max_questions, allow_empty=settings.allow_empty,
                                   skipped=skipped, kinds=kinds)
    if not questions:  # allow_empty let an empty set through: a fan-out of nothing has no report to merge
        raise ConfigError(f"--questions {', '.join(map(str, question_files))}: no question to evaluate; allow_empty "
                          "writes a report without one only without --ray")
    check_draft_target(draft, target)
    connect_ray(cfg.address)
    use_gpu = ray.cluster_resources().get("GPU", 0) > 0
    replicas = _replicas(cfg, settings, use_gpu, len(questions))
    cache = open_baselines(baselines, target, questions, settings, torch.device("cuda" if use_gpu else "cpu"),
                           replicas, 0 if use_gpu else max(1, round(cfg.num_cpus)))
    rows = [{"index": q["index"], "question": json.dumps(q), "cached": json.dumps(cache.for_question(q))}
            for q in questions]
    ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
        EvalReplica,
        fn_constructor_kwargs=dict(
            target=str(target), draft=str(draft), settings=to_dict(settings), use_gpu=use_gpu, num_cpus=cfg.num_cpus
        ),
        batch_size=1,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=replicas),
        num_gpus=settings.gpus if use_gpu else 0,  # the GPUs each replica spreads its target over
        num_cpus=cfg.num_cpus,
        **ACTOR_POOL,  # a replica that dies fails the evaluation, never retried without end
    )
    context = ray.data.DataContext.get_current()
    bars, context.enable_progress_bars = context.enable_progress_bars, False
    records: list[dict[str, Any]] = []
    placements: set[str] = set()
    answered: list[dict[str, Any]] = []  # per question: the node that answered it
    try:
        lines = ProgressLines("eval", len(rows), f"questions ({replicas} Ray replicas)", enabled=progress)
        if progress:  # the replicas load target + draft before the first question: said before they start
            print(f"[specdraft] eval: {len(rows)} questions on {replicas} Ray replica(s), loading target + draft",
                  flush=True)
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            for row in batch.to_pylist():
                done = json.loads(row["records"])
                records += done
                placements.add(row["placement"])
                answered.append({"node": row["node"], "ip": row["ip"], "questions": 1})
                lines.update(1, decoded_tokens(done))
    finally:
        context.enable_progress_bars = bars
    cache.absorb(records)
    extra = {"target": str(target), "draft": str(draft), "questions": [str(f) for f in question_files],
             "placement": [json.loads(p) for p in sorted(placements)],  # one entry per distinct replica placement
             "baselines": cache.summary()}
    return {**build_report(records, settings_dict(settings, **extra)), "questions_skipped": skipped,
            "question_kinds": kinds, "nodes": by_node(answered)}


def evaluate(
    target: str | Path,
    draft: str | Path,
    question_files: list[str | Path],
    out: str | Path | None = None,
    settings: EvalSettings = EvalSettings(),
    use_ray: bool = False,
    ray_cfg: RayEvalConfig = RayEvalConfig(),
    progress: bool = True,
    baselines_home: str | Path | None = None,
) -> dict[str, Any]:
    """Evaluate ``draft`` against ``target`` on question files; writes the report to ``out`` if given.

    Vanilla decoding and the prompt-lookup floor are read from (and added to) the cache
    ``baselines.baselines_dir`` names: ``baselines_home`` (the flow's ``<workdir>/eval/baselines``), else
    beside ``out``, unless ``settings.baselines`` names another directory or "off"."""
    started = time.perf_counter()
    if use_ray:
        report = evaluate_with_ray(target, draft, question_files, settings, ray_cfg, progress,
                                   baselines_dir(settings, out, baselines_home))
    else:
        report = run_eval(target, draft, question_files, settings, progress, out, baselines_home)
    if settings.engine.enabled:  # the engine users serve with, on the same questions (specdraft.evaluation.engine)
        log = Path(out).parent / "engine.log" if out is not None else None  # vLLM's own output, off the console
        report["engine"] = engine_report(target, draft, question_files, settings, log=log, progress=progress)
    report["settings"]["ray"] = to_dict(ray_cfg) if use_ray else None
    report["settings"]["stage_wall_s"] = time.perf_counter() - started
    if out is not None:
        write_report(report, out)
    return report

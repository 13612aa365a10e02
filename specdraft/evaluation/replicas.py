"""Questions spread over worker processes, each holding one copy of target + draft ("Judging LLM-as-a-Judge
with MT-Bench and Chatbot Arena": questions are independent, so evaluation is embarrassingly parallel).

``plan_workers`` decides the split: by default one worker per usable CPU core (each with one intra-op
thread: the small-batch decoding loop is bound by per-op overhead, which threads do not shrink) or, on
CUDA, one per ``settings.gpus`` GPUs (each worker sees only its own GPUs through
``CUDA_VISIBLE_DEVICES``); never more workers than questions; ``settings.workers`` overrides the count.
``evaluate_in_processes`` runs ``records.evaluate_question`` in the workers and returns the records in
any order (``report.build_report`` sorts them). A record depends only on (settings, question) — seeds
come from (seed, question index, turn) — so the split changes timings only.

Workers start with ``fork`` when that is safe (CPU, one thread per worker, a parent with no other
threads and no CUDA state: they start at once and share the imported modules), else from a
``forkserver`` that imported this module (torch, transformers, the drafts) once: a flow's process has
threads and evaluates several times a night, and each ``spawn``\ed worker paid the imports again
(~5 CPU-s a worker). ``spawn`` only where there is no forkserver.
The Ray path (``pipelines/evaluate.py``) spreads the same function over Ray actors instead.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import logging as hf_logging

from specdraft.config import from_dict, to_dict
from specdraft.configs.evaluation import EvalSettings
from specdraft.evaluation.models import load_models, warmup
from specdraft.evaluation.records import decoded_tokens, evaluate_question
from specdraft.placement import describe_placement, resolve_device
from specdraft.progress import ProgressLines


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    workers: int
    threads: int  # torch intra-op threads per worker (workers == 1: this process's, unchanged)
    device: torch.device  # the device every worker uses (CUDA: its own, through CUDA_VISIBLE_DEVICES)
    visible: tuple[str | None, ...]  # CUDA_VISIBLE_DEVICES of each worker (None: unchanged)

    def describe(self) -> dict[str, Any]:
        return {"workers": self.workers, "threads": self.threads, "device": self.device.type,
                "visible_devices": list(self.visible)}


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def plan_workers(settings: EvalSettings, questions: int) -> WorkerPlan:
    """How ``questions`` are spread for these ``EvalSettings`` (see the module docstring)."""
    device = resolve_device(settings.device)
    if device.type == "cuda":
        groups = 1
        if settings.device in ("auto", "cuda"):  # a named GPU (cuda:N) is one worker's
            groups = max(1, torch.cuda.device_count() // settings.gpus)
        workers = min(settings.workers or groups, groups, max(1, questions))
        visible = tuple(",".join(str(i * settings.gpus + g) for g in range(settings.gpus)) for i in range(workers))
        return WorkerPlan(workers, torch.get_num_threads(), device, visible if workers > 1 else (None,))
    cores = usable_cores()
    workers = max(1, min(settings.workers or cores, max(1, questions)))
    threads = torch.get_num_threads() if workers == 1 else max(1, cores // workers)
    return WorkerPlan(workers, threads, device, (None,) * workers)


_WORKER: dict[str, Any] = {}


def _start(target: str, draft: str, settings: dict[str, Any], threads: int, visible) -> None:
    """Worker initializer: its devices and threads, then target + draft loaded once (and warmed up)."""
    slot = visible.get() if visible is not None else None
    if slot is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = slot
    torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()  # a "Loading weights" bar per worker between the eval's progress lines
    parsed = from_dict(EvalSettings, settings)
    if slot is not None:
        parsed = from_dict(EvalSettings, {**settings, "device": "cuda"})
    models = load_models(target, draft, parsed)
    if parsed.warmup:
        warmup(models, parsed)
    _WORKER.update(models=models, settings=parsed, placement=json.dumps(describe_placement(models.target)))


def _evaluate(question: dict[str, Any], cached: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    return evaluate_question(_WORKER["models"], question, _WORKER["settings"], cached), _WORKER["placement"]


def _context(plan: WorkerPlan):
    methods = multiprocessing.get_all_start_methods()
    if (plan.device.type == "cpu" and plan.threads == 1 and threading.active_count() == 1
            and not torch.cuda.is_initialized() and "fork" in methods):
        return multiprocessing.get_context("fork")
    if "forkserver" not in methods:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # the server (one per process, started by the first pool) imports this module before it forks a worker; it
    # never touches CUDA, so a worker may take its own GPUs; a preload that fails to import is only slower
    ctx.set_forkserver_preload([__name__])
    return ctx


def evaluate_in_processes(target, draft, questions: list[dict[str, Any]], cached: list[dict[str, Any]], settings,
                          plan: WorkerPlan, progress: bool = True) -> tuple[list[dict[str, Any]], list[dict]]:
    """Every question's records from ``plan.workers`` worker processes, and the workers' placements."""
    ctx = _context(plan)
    slots = None
    if any(v is not None for v in plan.visible):
        slots = ctx.Queue()
        for v in plan.visible:
            slots.put(v)
    records: list[dict[str, Any]] = []
    placements: set[str] = set()
    with ProcessPoolExecutor(max_workers=plan.workers, mp_context=ctx, initializer=_start,
                             initargs=(str(target), str(draft), to_dict(settings), plan.threads, slots)) as pool:
        futures = [pool.submit(_evaluate, q, c) for q, c in zip(questions, cached)]
        lines = ProgressLines("eval", len(futures), f"questions ({plan.workers} workers)", enabled=progress)
        for future in as_completed(futures):
            rows, placement = future.result()
            records += rows
            placements.add(placement)
            lines.update(1, decoded_tokens(rows))
    return records, [json.loads(p) for p in sorted(placements)]

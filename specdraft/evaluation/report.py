"""An evaluation's report: per-turn records aggregated per dataset and per turn, beside the prompt-lookup
floor (docs/evaluation.md; τ, α_i and speedup as in "EAGLE-2: Faster Inference
of Language Models with Dynamic Draft Trees", §5; the metrics themselves are ``decoding.metrics.summarize``).

The summary reports ``tau_pld``, ``alpha_pld``, ``pld_lossless`` and ``tau_over_pld`` beside the draft's τ;
the report's ``settings`` hold the evaluation settings, where it ran and what the baseline cache compared;
every block's ``load_1m`` is the machine's load average while its turns ran, beside its speedups.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specdraft import files
from specdraft.config import to_dict
from specdraft.configs.evaluation import EvalSettings
from specdraft.decoding.metrics import summarize


def settings_dict(settings: EvalSettings, **extra: Any) -> dict[str, Any]:
    return {**to_dict(settings), **extra, "torch": torch.__version__}


def build_report(records: list[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
    """Per-dataset metrics with a per-turn breakdown, overall metrics, and the records."""
    records = sorted(records, key=lambda r: (r["index"], r["turn"]))
    datasets: dict[str, Any] = {}
    for name in dict.fromkeys(r["dataset"] for r in records):
        rows = [r for r in records if r["dataset"] == name]
        turns = sorted({r["turn"] for r in rows})
        datasets[name] = {
            **summarize(rows),
            "turns": {str(t): summarize(r for r in rows if r["turn"] == t) for t in turns},
        }
    return {"settings": settings, "datasets": datasets, "overall": summarize(records), "records": records}


def write_report(report: dict[str, Any], path: str | Path) -> Path:
    """Write the report as JSON, whole (temporary name, then rename)."""
    return files.write_text(path, json.dumps(report, indent=2) + "\n")

"""Plots for the MLflow UI: acceptance per draft depth per dataset, and training curves."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_alpha(report: dict, out: str | Path) -> Path:
    """Bar chart of alpha_i (acceptance rate per draft depth) for each dataset of an eval report."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(report["datasets"])
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        alpha = [a if a is not None else 0.0 for a in report["datasets"][name]["alpha"]]
        ax.bar([i + j * width for i in range(len(alpha))], alpha, width=width,
               label=f"{name} (tau {report['datasets'][name]['tau'] or 0:.2f})")
    ax.set_xlabel("draft depth i")
    ax.set_ylabel("alpha_i")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("acceptance rate per draft depth")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)


def plot_training(metrics_jsonl: str | Path, out: str | Path) -> Path:
    """Loss per optimizer step (coloured by stage) and sim_tau per validation pass."""
    records = [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("kind") == "metrics" and "loss" in r]
    vals = [r for r in records if r.get("kind") == "metrics" and "sim_tau" in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    for stage in sorted({r.get("stage", 0.0) for r in steps}):
        pts = [(r["step"], r["loss"]) for r in steps if r.get("stage", 0.0) == stage]
        a.plot([p[0] for p in pts], [p[1] for p in pts], label=f"stage {int(stage)}")
    a.set_xlabel("step")
    a.set_ylabel("loss")
    a.set_yscale("log")
    a.legend(fontsize=8)
    b.plot([r["step"] for r in vals], [r["sim_tau"] for r in vals], marker="o")
    b.set_xlabel("step")
    b.set_ylabel("sim_tau (held-out)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)

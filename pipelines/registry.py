"""Model registry: register the trained draft and move the champion alias only on a better tau.

The draft directory (``config.json`` + ``model.safetensors``, loadable on its own) is
logged as the run's ``draft`` artifact and registered as a new version of the configured
model. The alias (default ``champion``) moves to it only when its mean tau beats the
current champion's on the same eval sets and settings (``eval_key``); the decision and
both tau values are recorded as tags on the version and the run. A champion measured on
other eval sets is re-evaluated on the current ones first (``evaluate_champion``), so
the comparison is always like for like.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient


def _tau_tag(eval_key: str) -> str:
    return f"mean_tau.{eval_key}"


def current_champion(client: MlflowClient, name: str, alias: str):
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def register_draft(
    client: MlflowClient,
    *,
    run_id: str,
    draft_dir: str | Path,
    model_name: str,
    alias: str,
    eval_key: str,
    mean_tau: float,
    taus: dict[str, float],
    train_key: str = "",
    evaluate_champion: Callable[[str], float | None] | None = None,
) -> dict[str, Any]:
    """Register ``draft_dir`` (logged into ``run_id``) and apply the champion gate.

    Idempotent per ``train_key``: a draft already registered (a rerun of finished work) is
    not registered twice.
    """
    if train_key:
        try:
            existing = [v for v in client.search_model_versions(f"name='{model_name}'")
                        if v.tags.get("train_key") == train_key]
        except MlflowException:
            existing = []
        if existing:
            v = existing[0]
            champion = current_champion(client, model_name, alias)
            return {"model_name": model_name, "version": int(v.version), "mean_tau": mean_tau, "alias": alias,
                    "promoted": champion is not None and champion.version == v.version,
                    "champion_version": int(champion.version) if champion else None, "champion_mean_tau": None,
                    "reason": "already registered (same trained draft)"}
    client.log_artifacts(run_id, str(draft_dir), "draft")
    try:
        client.create_registered_model(model_name, description="specdraft speculative-decoding drafts")
    except MlflowException:
        pass  # exists
    version = client.create_model_version(
        model_name, source=f"runs:/{run_id}/draft", run_id=run_id,
        tags={_tau_tag(eval_key): f"{mean_tau:.6f}", "eval_key": eval_key, "taus": json.dumps(taus),
              "train_key": train_key},
    )
    champion = current_champion(client, model_name, alias)
    champion_tau = None
    if champion is not None:
        tagged = champion.tags.get(_tau_tag(eval_key))
        if tagged is not None:
            champion_tau = float(tagged)
        elif evaluate_champion is not None:
            champion_tau = evaluate_champion(f"models:/{model_name}/{champion.version}")
            if champion_tau is not None:
                client.set_model_version_tag(model_name, champion.version, _tau_tag(eval_key), f"{champion_tau:.6f}")
    promote = champion is None or (champion_tau is not None and mean_tau > champion_tau)
    if promote:
        client.set_registered_model_alias(model_name, alias, version.version)
    decision = {
        "model_name": model_name,
        "version": int(version.version),
        "mean_tau": mean_tau,
        "champion_version": int(champion.version) if champion is not None else None,
        "champion_mean_tau": champion_tau,
        "promoted": promote,
        "alias": alias,
        "reason": (
            "no champion yet" if champion is None
            else "champion tau unknown on these eval sets" if champion_tau is None
            else f"tau {mean_tau:.4f} {'>' if promote else '<='} champion {champion_tau:.4f}"
        ),
    }
    for key, value in decision.items():
        client.set_model_version_tag(model_name, version.version, f"gate.{key}", str(value))
        client.set_tag(run_id, f"gate.{key}", str(value))
    return decision

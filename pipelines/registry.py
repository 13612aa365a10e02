"""Model registry: register the trained draft and move the champion alias when the promotion decision says so
(docs/evaluation.md, docs/serving.md). The decision itself is ``specdraft.freshness.promotion.decide_promotion``
(no MLflow); this module is its I/O.

The draft directory (``config.json`` + ``model.safetensors``, loadable on its own) is logged as the run's
``draft`` artifact and registered as a new version of the configured model. The alias (default ``champion``)
moves to it when the decision promotes it: above the prompt-lookup floor and better than the champion (or the
gate's verdict) on the same eval sets and settings (``eval_key``). The decision, both values and the floor are
recorded as tags on the version and the run. A champion measured on other eval sets is re-evaluated on the
current ones first (``evaluate_champion``), so the comparison is always like for like.

Serving: the draft's exports (``specdraft.export``: the speculators / SGLang / EAGLE formats
that fit its architecture) are logged beside it as ``export/<format>`` artifacts of the
version's run, and the version is tagged with its architecture and target, so the champion's
exports can be fetched and served (``champion_exports``) and ``specdraft export --model-uri
models:/NAME@champion`` can rebuild them from the registered draft.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import mlflow
from mlflow.entities import RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from specdraft.freshness.engine_gate import EngineVerdict
from specdraft.freshness.promotion import Champion, Measure, Measures, decide_promotion

BEST_K_TAG = "specdraft.best_k"  # a version's fastest K in the engine (its eval's sweep): its serve commands' K

EXPORT_DIR = "export"  # artifact folder of the version's run: export/<format>/{config.json,model.safetensors}


class ChampionUnusable(ValueError):
    """A registered champion this night cannot load: its draft's artifacts gone, or files or tensors missing from
    them. One line naming the version and what is missing."""


def _tau_tag(eval_key: str) -> str:
    return f"mean_tau.{eval_key}"


def _floor_tag(eval_key: str) -> str:
    return f"mean_tau_pld.{eval_key}"


def _engine_tag(eval_key: str) -> str:
    return f"mean_engine_tau.{eval_key}"


def version_uri(name: str, version: int | str) -> str:
    """``models:/NAME/VERSION``: a registered draft's URI, also the evaluation key of a champion (``champion:URI``):
    the offline drift check and the gate measure the champion on the window's held-out slice once a night."""
    return f"models:/{name}/{version}"


def current_champion(client: MlflowClient, name: str, alias: str):
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def register_draft(
    client: MlflowClient, *, run_id: str, draft_dir: str | Path, model_name: str, alias: str, eval_key: str,
    measures: Measures, taus: dict[str, float], train_key: str = "", evaluate_champion: Callable[[str], Any] | None = None,
    tags: dict[str, str] | None = None, gate: Callable[[float | None, str | None], Any] | None = None,
    champion_unusable: str = "", engine: EngineVerdict | None = None,
) -> dict[str, Any]:
    """Register ``draft_dir`` (logged into ``run_id``), apply the promotion decision
    (``specdraft.freshness.promotion.decide_promotion``) and move ``alias`` when it promotes; ``tags`` go on the
    version. This function is the decision's MLflow I/O: the champion's values read from its version tags (or
    re-evaluated), the gate asked, the alias moved and the decision recorded as ``gate.*`` tags.

    ``measures``: the candidate's mean tau, the prompt-lookup floor of the same evaluation and the serving engine's
    mean acceptance length (with it, champion and challenger are compared by the engine's numbers);
    ``taus``: the tau per eval set (a version tag). ``evaluate_champion(models:/NAME/VERSION)`` re-evaluates a
    champion measured on other eval sets: its mean tau, or (mean tau, mean engine acceptance).

    ``gate(champion value on the eval sets, champion model URI or None)``: the promotion gate
    (``specdraft.freshness.gate.decide``, ``gate.enabled``), whose verdict replaces "beats the champion on the eval
    sets": the eval sets are then its regression set, the window's held-out slice its other comparison. Its
    record is the decision's ``gate`` and its comparisons are ``gate.<slice>.<field>`` tags.

    ``champion_unusable``: why the champion cannot be loaded ("" when it can; ``ChampionUnusable``, also raised by
    ``evaluate_champion`` or ``gate``): it cannot be compared, so the draft is judged against the floor alone.

    ``engine``: the engine rule's verdict (``specdraft.freshness.engine_gate.engine_verdict``; None: no engine
    measured the draft): a draft it refuses is not promoted whatever the rest says, and the reason ends with its
    numbers (``decide_promotion``).

    Idempotent per ``train_key``: a draft already registered (a rerun of finished work) is
    not registered twice. The decision names the version's run (``run_id``).
    """
    found = _registered_before(client, run_id, model_name, alias, train_key, measures.tau, measures.floor)
    if found is not None:
        return found
    version = _create_version(client, run_id, draft_dir, model_name, eval_key, measures, taus, train_key, tags)
    champion = current_champion(client, model_name, alias)
    unusable = champion_unusable if champion is not None else ""
    champion_tau = gated = None
    try:
        if champion is not None and not unusable:
            champion_tau = _champion_tau(client, model_name, champion, eval_key, measures.measure,
                                         measures.above_floor, evaluate_champion)
        if gate is not None and measures.above_floor is not False and not unusable:
            gated = gate(champion_tau, version_uri(model_name, champion.version) if champion is not None else None)
    except ChampionUnusable as err:  # found when it was downloaded to be measured
        unusable, champion_tau, gated = str(err), None, None
    decided = decide_promotion(measures, None if champion is None else Champion(value=champion_tau,
                                                                                 unusable=unusable), gated, engine)
    if decided.promote:
        client.set_registered_model_alias(model_name, alias, version.version)
    decision = {
        "model_name": model_name, "version": int(version.version), "run_id": run_id, "mean_tau": measures.tau,
        "champion_version": int(champion.version) if champion is not None else None, "champion_mean_tau": champion_tau,
        "compared_by": decided.compared_by, "mean_engine_tau": measures.engine_tau,
        "mean_tau_pld": measures.floor, "tau_over_pld": measures.tau / measures.floor if measures.floor else None,
        "above_floor": decided.above_floor, "promoted": decided.promote, "alias": alias,
        "engine_gate": engine.to_dict() if engine is not None else None,
        "engine_best_k": engine.draft_k if engine is not None else None, "reason": decided.reason,
    }
    gate_tags = {f"gate.{key}": str(value) for key, value in decision.items() if key != "run_id"}
    if gated is not None:
        decision["gate"] = gated.to_dict()
        gate_tags.update({f"gate.{c.slice}.{key}": str(getattr(c, key)) for c in gated.comparisons
                          for key in ("candidate", "champion", "change", "bound", "passed")})
    for key, value in gate_tags.items():  # on the version and on its run
        client.set_model_version_tag(model_name, version.version, key, value)
        client.set_tag(run_id, key, value)
    return decision


def _create_version(client: MlflowClient, run_id: str, draft_dir: str | Path, model_name: str, eval_key: str,
                    measures: Measures, taus: dict[str, float], train_key: str, tags: dict[str, str] | None):
    """The draft logged as ``run_id``'s ``draft`` artifact and registered as a new version of ``model_name``
    (created when new), tagged with its measures on ``eval_key``."""
    client.log_artifacts(run_id, str(draft_dir), "draft")
    try:
        client.create_registered_model(model_name, description="specdraft speculative-decoding drafts")
    except MlflowException:
        pass  # exists
    version_tags = {_tau_tag(eval_key): f"{measures.tau:.6f}", "eval_key": eval_key, "taus": json.dumps(taus),
                    "train_key": train_key, **(tags or {}),
                    **({_floor_tag(eval_key): f"{measures.floor:.6f}"} if measures.floor is not None else {}),
                    **({_engine_tag(eval_key): f"{measures.engine_tau:.6f}"} if measures.engine_tau is not None
                       else {})}
    return client.create_model_version(model_name, source=f"runs:/{run_id}/draft", run_id=run_id, tags=version_tags)


def _registered_before(client: MlflowClient, run_id: str, model_name: str, alias: str, train_key: str,
                       mean_tau: float, mean_tau_pld: float | None) -> dict[str, Any] | None:
    """The decision for a draft already registered under ``train_key`` (a rerun of finished work), recorded
    on the run asking; None when there is none (or no ``train_key``)."""
    if not train_key:
        return None
    try:
        existing = [v for v in client.search_model_versions(f"name='{model_name}'")
                    if v.tags.get("train_key") == train_key]
    except MlflowException:
        existing = []
    if not existing:
        return None
    v = existing[0]
    champion = current_champion(client, model_name, alias)
    decision = {"model_name": model_name, "version": int(v.version), "run_id": v.run_id, "mean_tau": mean_tau,
                "alias": alias,
                "promoted": champion is not None and champion.version == v.version,
                "champion_version": int(champion.version) if champion else None, "champion_mean_tau": None,
                "mean_tau_pld": mean_tau_pld,
                "reason": f"already registered (same trained draft) as v{v.version} by run {v.run_id}"}
    # the run asking records what it found: the version, its run, the champion now (nothing is registered)
    client.log_batch(run_id, tags=[RunTag(f"gate.{'version_run_id' if k == 'run_id' else k}", str(value))
                                   for k, value in decision.items()])
    return decision

def _champion_tau(client: MlflowClient, model_name: str, champion, eval_key: str, measure: Measure,
                  above_floor: bool | None, evaluate_champion: Callable[[str], Any] | None) -> float | None:
    """The champion's ``measure`` on ``eval_key`` (the engine's acceptance or tau): from its tags, or re-evaluated
    (and tagged) when it was measured on other eval sets; None when unknown."""
    if champion is None:
        return None
    tag = _engine_tag(eval_key) if measure.by_engine else _tau_tag(eval_key)
    tagged = champion.tags.get(tag)
    if tagged is not None:
        return float(tagged)
    if evaluate_champion is None or above_floor is False:  # below the floor: no need
        return None
    measured = evaluate_champion(version_uri(model_name, champion.version))
    taus = measured if isinstance(measured, tuple) else (measured, None)
    for key, value in zip((_tau_tag(eval_key), _engine_tag(eval_key)), taus):
        if value is not None:
            client.set_model_version_tag(model_name, champion.version, key, f"{value:.6f}")
    return measure.of(*taus)


def log_exports(client: MlflowClient, run_id: str, exports: dict[str, str]) -> list[str]:
    """Log each exported directory (format -> path) as ``export/<format>`` of ``run_id`` unless it is there
    already (a retried or rerun stage); returns the formats logged now."""
    present = {Path(a.path).name for a in client.list_artifacts(run_id, EXPORT_DIR)}
    logged = []
    for fmt, path in sorted(exports.items()):
        if fmt not in present:
            client.log_artifacts(run_id, str(path), f"{EXPORT_DIR}/{fmt}")
            logged.append(fmt)
    return logged


def resolve_version(client: MlflowClient, model_uri: str):
    """The model version ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION`` names."""
    match = re.fullmatch(r"models:/([^/@]+)(?:@([^/]+)|/(\d+))", model_uri)
    if not match:
        raise ValueError(f"{model_uri!r} is not a model URI of the form models:/NAME@ALIAS or models:/NAME/VERSION")
    name, alias, number = match.groups()
    try:
        return client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, number)
    except MlflowException as err:
        raise ValueError(f"{model_uri}: no such registered model version ({err.message})") from None


def download_draft(client: MlflowClient, model_uri: str, dst: str | Path) -> tuple[Path, Any]:
    """Download the draft directory a registered version points at into ``dst``; returns it and the version."""
    version = resolve_version(client, model_uri)
    local = mlflow.artifacts.download_artifacts(version.source, dst_path=str(dst), tracking_uri=client.tracking_uri)
    return Path(local), version


def champion_exports(client: MlflowClient, name: str, alias: str, dst: str | Path,
                     local: dict[int, dict[str, str]] | None = None) -> dict[str, Any]:
    """The exported formats of the version holding ``alias``: the directories in ``local`` (version -> format ->
    path, e.g. what this run just exported) or downloaded under ``dst/v<version>/`` (kept between runs). ``{}``
    when there is no champion; a version registered before exports existed has none."""
    champion = current_champion(client, name, alias)
    if champion is None:
        return {}
    root = Path(dst) / f"v{champion.version}"
    exports = dict((local or {}).get(int(champion.version)) or {})
    for artifact in [] if exports else client.list_artifacts(champion.run_id, EXPORT_DIR):
        fmt = Path(artifact.path).name
        if not (root / fmt / "config.json").is_file():
            mlflow.artifacts.download_artifacts(run_id=champion.run_id, artifact_path=artifact.path,
                                                dst_path=str(root), tracking_uri=client.tracking_uri)
        exports[fmt] = str(root / fmt)
    best_k = champion.tags.get(BEST_K_TAG)
    return {"version": int(champion.version), "exports": exports, "arch": champion.tags.get("specdraft.arch", ""),
            "best_k": int(best_k) if best_k and best_k.isdigit() else None,  # the engine's fastest K, when measured
            "recipe": champion.tags.get("specdraft.recipe", ""), "target": champion.tags.get("specdraft.target", "")}


def _tag_number(tags: dict[str, str], key: str) -> float | None:
    try:
        return float(tags[key])
    except (KeyError, ValueError):  # absent, or "None"
        return None


def version_history(client: MlflowClient, name: str, alias: str = "champion", limit: int = 14) -> list[dict[str, Any]]:
    """The gate's decisions on the last ``limit`` versions of ``name``, oldest first: each version's (the
    challenger's) mean tau, the champion's tau it was compared with, the floor, whether it was promoted
    (``gate.*`` tags; None where a version predates them) and whether it holds ``alias`` now (``champion``).
    ``[]`` when the model does not exist."""
    try:
        versions = sorted(client.search_model_versions(f"name='{name}'"), key=lambda v: int(v.version))[-limit:]
    except MlflowException:
        return []
    holder = current_champion(client, name, alias)
    return [{"version": int(v.version), "created": v.creation_timestamp, "run_id": v.run_id,
             "mean_tau": _tag_number(v.tags, "gate.mean_tau"),
             "champion_mean_tau": _tag_number(v.tags, "gate.champion_mean_tau"),
             "mean_tau_pld": _tag_number(v.tags, "gate.mean_tau_pld"),
             "promoted": v.tags.get("gate.promoted") == "True", "eval_key": v.tags.get("eval_key", ""),
             "champion": holder is not None and holder.version == v.version}
            for v in versions]

"""A champion that cannot be loaded (issue 44, item 7): its vocabulary maps missing from model.safetensors, or its
MLflow artifacts gone. ``specdraft.run.warm_start_gap`` names what a draft directory lacks; the night's warm start
(``pipelines.freshness.champion_draft``) then trains from scratch with one line naming the version and what is
missing, and the offline drift check says it did not measure — instead of ``SafetensorError ... heads.d2t`` or
``MlflowException: Failed to download artifacts``. Neighbours: a loadable champion, a draft over the target's
vocabulary (no maps to miss), no champion, tracking off."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from pipelines.freshness import champion_draft, offline_drift
from specdraft.freshness.promotion import Measures
from specdraft.freshness.record import TrafficFiles, TrafficRecord
from pipelines.records import Prepared
from pipelines.configs import RunConfig
from pipelines.tracking import MlflowLogger, NullRun
from specdraft.config import from_dict
from specdraft.models import build_draft, draft_config_from_target, save_draft
from specdraft.run import warm_start_gap
from specdraft.targets.loading import load_target_config
from tests.pipelines.test_warm_start import _draft


def _without(draft: Path, out: Path, *keys: str) -> Path:
    """A copy of the draft directory whose model.safetensors lacks ``keys``."""
    shutil.copytree(draft, out)
    tensors = load_file(str(out / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k not in keys}, str(out / "model.safetensors"))
    return out


def test_warm_start_gap_names_what_a_draft_directory_lacks(tiny_toy_target, tmp_path):
    good = save_draft(_draft(tiny_toy_target, list(range(32)), seed=1), tmp_path / "good")
    assert warm_start_gap(good) == ""
    no_maps = _without(good, tmp_path / "no-maps", "heads.d2t", "heads.t2d")
    assert warm_start_gap(no_maps) == "its draft vocabulary maps heads.d2t, heads.t2d missing from model.safetensors"
    one_map = _without(good, tmp_path / "one-map", "heads.d2t")
    assert warm_start_gap(one_map) == "its draft vocabulary maps heads.d2t missing from model.safetensors"
    weights = sorted(k for k in load_file(str(good / "model.safetensors")) if not k.startswith("heads."))
    no_weights = _without(good, tmp_path / "no-weights", *weights)
    assert warm_start_gap(no_weights).startswith(f"{len(weights)} weight tensors (")
    (tmp_path / "none").mkdir()
    assert warm_start_gap(tmp_path / "none") == "config.json and model.safetensors missing"
    truncated = shutil.copytree(good, tmp_path / "truncated")
    (truncated / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:40])
    assert warm_start_gap(truncated).startswith("unreadable (")
    config = draft_config_from_target(load_target_config(tiny_toy_target), "beagle")
    full_vocab = save_draft(build_draft(config), tmp_path / "full-vocab")  # the target's vocabulary: no maps
    assert warm_start_gap(full_vocab) == ""


def _register(logger: MlflowLogger, draft: Path, name: str) -> str:
    """Register ``draft`` as a new version of ``name`` and make it the champion; returns its version."""
    logger.client.log_artifacts(logger.run_id, str(draft), "draft")
    if not logger.client.search_registered_models(f"name='{name}'"):
        logger.client.create_registered_model(name)
    version = logger.client.create_model_version(name, source=f"runs:/{logger.run_id}/draft", run_id=logger.run_id)
    logger.client.set_registered_model_alias(name, "champion", version.version)
    return version.version


def test_an_unloadable_champion_is_one_line_and_the_night_trains_from_scratch(tiny_toy_target, tmp_path, caplog):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    artifacts = tmp_path / "artifacts"
    parent = MlflowLogger(uri, experiment="champions", artifact_location=str(artifacts))
    cfg = from_dict(RunConfig, {"workdir": str(tmp_path / "runs"), "tracking": {"uri": uri},
                                "register": {"model_name": "d"}, "monitor": {"offline": True}})
    log = logging.getLogger("night")
    assert champion_draft(cfg, parent, log) == ("", "")  # no champion yet: from scratch, nothing to warn of
    assert champion_draft(cfg, NullRun(), log) == ("", "")  # tracking off
    good = save_draft(_draft(tiny_toy_target, list(range(32)), seed=1), tmp_path / "good")
    _register(MlflowLogger(uri, experiment="champions"), good, "d")
    path, note = champion_draft(cfg, parent, log)
    assert note == "" and (Path(path) / "model.safetensors").is_file() and warm_start_gap(path) == ""
    version = _register(MlflowLogger(uri, experiment="champions"),
                        _without(good, tmp_path / "no-maps", "heads.d2t", "heads.t2d"), "d")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        path, note = champion_draft(cfg, parent, log)
    assert path == "" and note.startswith(f"champion v{version} (models:/d/{version}, downloaded to ")
    assert "its draft vocabulary maps heads.d2t, heads.t2d missing" in note and note.endswith("trained from scratch")
    [record] = [r for r in caplog.records if r.name == "night"]
    assert "\n" not in record.getMessage() and "training from scratch" in record.getMessage()
    gone_run = MlflowLogger(uri, experiment="champions")
    version = _register(gone_run, good, "d")
    shutil.rmtree(artifacts / gone_run.run_id)  # the champion's artifacts deleted from the store
    path, note = champion_draft(cfg, parent, log)
    assert path == "" and note.startswith(f"champion v{version} (models:/d/{version}): its draft's artifacts cannot "
                                          "be downloaded from runs:/")
    assert not (tmp_path / "runs" / "champion" / f"v{version}").exists()  # nothing half-downloaded left
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("")
    prepared = Prepared(target=str(tiny_toy_target), target_id="t", prompts=[], wall_s=0.0,
                        traffic=TrafficRecord(files=TrafficFiles(held_out=str(held_out))))
    drift = offline_drift(cfg, parent, prepared, log)  # the drift check says so too, and is no alarm
    assert drift["alarm"] is False and drift["message"].startswith(f"not measured: champion v{version}")


def test_a_champion_not_served_is_handed_off_from_the_registry(tiny_toy_target, tmp_path):
    """Issue 44 item 5, a night that registers nothing (it skipped training — as the rerun of a night killed during
    its hand-off does with ``retrain.policy=when_it_pays``): ``current`` is made the champion from the registry, its
    draft and exports downloaded. Neighbours: already served (nothing written), a rollback (left alone, said), a
    champion that cannot be loaded (said, ``current`` kept), tracking or the hand-off off, no champion."""
    from pipelines.freshness import serve_champion
    from specdraft.freshness.handoff import read_meta, rollback

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    artifacts = tmp_path / "artifacts"
    parent = MlflowLogger(uri, experiment="champions", artifact_location=str(artifacts))
    cfg = from_dict(RunConfig, {"workdir": str(tmp_path / "runs"), "tracking": {"uri": uri},
                                "register": {"model_name": "d"}})
    prepared = Prepared(target=str(tiny_toy_target), target_id="t", prompts=[], wall_s=0.0)
    log = logging.getLogger("night")
    root = tmp_path / "runs" / "exports"
    assert serve_champion(cfg, parent, prepared, log) == {}  # no champion yet
    good = save_draft(_draft(tiny_toy_target, list(range(32)), seed=1), tmp_path / "good")
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text('{"architectures": ["Eagle3Speculator"]}')  # what serve commands read
    first = MlflowLogger(uri, experiment="champions")
    first.client.log_artifacts(first.run_id, str(export), "export/speculators")
    v1 = _register(first, good, "d")
    assert serve_champion(cfg, NullRun(), prepared, log) == {}  # tracking off: no registry to read
    off = from_dict(RunConfig, {"workdir": str(tmp_path / "runs"), "handoff": {"enabled": False}})
    assert serve_champion(off, parent, prepared, log) == {}
    out = serve_champion(cfg, parent, prepared, log)
    assert out["version"] == int(v1) and out["served_version"] == int(v1) and out["served_note"] == ""
    assert read_meta(root / "current")["version"] == int(v1) and (root / "current" / "draft" / "model.safetensors").is_file()
    assert (root / "current" / "speculators" / "config.json").read_text() == '{"architectures": ["Eagle3Speculator"]}'
    assert str(root / "current" / "speculators") in out["restart"]  # the serve command points at current
    published = read_meta(root / "current")["published"]
    again = serve_champion(cfg, parent, prepared, log)
    assert "handoff" not in again and read_meta(root / "current")["published"] == published
    v2 = _register(MlflowLogger(uri, experiment="champions"), good, "d")
    assert serve_champion(cfg, parent, prepared, log)["version"] == int(v2)
    rollback(root)
    back = serve_champion(cfg, parent, prepared, log)
    assert "handoff" not in back and f"rolled back from the champion v{v2}" in back["served_note"]
    rollback(root)
    gone = MlflowLogger(uri, experiment="champions")
    v3 = _register(gone, good, "d")
    shutil.rmtree(artifacts / gone.run_id)
    lost = serve_champion(cfg, parent, prepared, log)
    assert "handoff" not in lost and lost["served_version"] == int(v2)
    assert f"serves v{v2} but the registry's champion is v{v3}, which cannot be handed off: champion v{v3}" in \
        lost["served_note"] and "artifacts cannot be downloaded" in lost["served_note"]


def test_the_register_stage_judges_a_draft_against_the_floor_when_the_champion_cannot_be_loaded(tiny_toy_target,
                                                                                                tmp_path, caplog):
    """The register stage's comparison (``champion_unusable`` before ``register_draft``, and ``champion_local``, which
    its champion re-evaluation and the gate download through): a champion that cannot be loaded is not compared,
    the draft is judged against the floor and the reason names the version and what is missing — never the
    ``MlflowException`` of a download. Neighbours: a loadable champion still compared (and beating it, or not), an
    unusable one found only when it is downloaded to be re-evaluated, a draft below the floor (not promoted)."""
    from pipelines.freshness import champion_local, champion_unusable
    from pipelines.registry import register_draft

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    artifacts = tmp_path / "artifacts"
    parent = MlflowLogger(uri, experiment="champions", artifact_location=str(artifacts))
    cfg = from_dict(RunConfig, {"workdir": str(tmp_path / "runs"), "tracking": {"uri": uri},
                                "register": {"model_name": "d"}})
    log = logging.getLogger("night")
    good = save_draft(_draft(tiny_toy_target, list(range(32)), seed=1), tmp_path / "good")
    no_maps = _without(good, tmp_path / "no-maps", "heads.d2t", "heads.t2d")

    def champion(draft: Path, tau: float | None) -> tuple[str, MlflowLogger]:
        run = MlflowLogger(uri, experiment="champions")
        version = _register(run, draft, "d")
        if tau is not None:  # measured on this night's eval sets: no re-evaluation needed to compare
            run.client.set_model_version_tag("d", version, "mean_tau.k", str(tau))
        return version, run

    def night(tau: float, pld: float = 1.0, **kw) -> dict:
        run = MlflowLogger(uri, experiment="champions")
        return register_draft(run.client, run_id=run.run_id, draft_dir=good, model_name="d", alias="champion",
                              eval_key="k", measures=Measures(tau=tau, floor=pld), taus={"k": tau},
                              champion_unusable=champion_unusable(cfg, parent, log), **kw)

    v1, _ = champion(good, 2.0)
    assert champion_unusable(cfg, parent, log) == ""  # loadable: compared as before
    lost = night(1.5)
    assert not lost["promoted"] and lost["reason"].endswith("tau 1.5000 <= champion 2.0000")
    won = night(2.5)
    assert won["promoted"] and won["champion_version"] == int(v1) and won["reason"].endswith("> champion 2.0000")
    v3, _ = champion(no_maps, 9.0)  # better on paper, but its vocabulary maps are missing
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        judged = night(1.5)
    assert judged["promoted"] and judged["champion_version"] == int(v3) and judged["champion_mean_tau"] is None
    floor, why = judged["reason"].split("; ", 1)
    assert floor == "tau 1.5000 > prompt-lookup floor 1.0000"
    assert why.startswith(f"the champion could not be loaded, not compared (judged against the floor alone): "
                          f"champion v{v3} (models:/d/{v3}, downloaded to ")
    assert why.endswith("its draft vocabulary maps heads.d2t, heads.t2d missing from model.safetensors")
    [record] = [r for r in caplog.records if r.name == "night"]
    assert "\n" not in record.getMessage() and f"champion v{v3}" in record.getMessage()
    v5, gone = champion(good, None)  # its tau on these eval sets unknown: it would be downloaded to be measured
    shutil.rmtree(artifacts / gone.run_id)
    below = night(0.9)  # below the floor: not promoted, whatever the champion
    assert not below["promoted"] and below["reason"].startswith("tau 0.9000 <= prompt-lookup floor tau_pld 1.0000")
    measured = []
    found_late = register_draft(  # the champion found unusable only when downloaded to be re-evaluated
        gone.client, run_id=MlflowLogger(uri, experiment="champions").run_id, draft_dir=good, model_name="d",
        alias="champion", eval_key="k", measures=Measures(tau=1.2, floor=1.0), taus={"k": 1.2},
        evaluate_champion=lambda u: measured.append(champion_local(cfg, parent, u)))
    assert found_late["promoted"] and not measured and (
        f"not compared (judged against the floor alone): champion v{v5} (models:/d/{v5}): its draft's artifacts "
        "cannot be downloaded from runs:/") in found_late["reason"]

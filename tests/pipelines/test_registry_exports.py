"""Registry and serving exports on a real MLflow SQLite store: register, export in the formats that fit
the draft, log them beside the version, fetch the champion's exports and its serve commands, and the
``specdraft export`` command (a draft directory or ``--model-uri models:/NAME@champion``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.cli import main
from pipelines import stages
from pipelines.registry import champion_exports, download_draft, log_exports, register_draft, resolve_version
from specdraft.freshness.promotion import Measures
from pipelines.records import Prepared
from pipelines.configs import RunConfig
from specdraft.config import load
from specdraft.export import check_export, export_spec, serve_commands
from specdraft.export.commands import vllm_server
from specdraft.models import save_draft
from specdraft.targets.identity import target_id
from tests.specdraft.decoding.decoding_helpers import tiny_draft, tiny_target


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A saved random 4-layer target, an EAGLE-3, a HASS-architecture (eagle), a Beagle and a Beagle-over-EAGLE-3
    (beagle3) draft, a tracking store."""
    root = tmp_path_factory.mktemp("registry")
    target = tiny_target(num_hidden_layers=4, max_position_embeddings=4096)
    target.save_pretrained(root / "target")
    drafts = {arch: str(save_draft(tiny_draft(target, arch), root / arch))
              for arch in ("eagle3", "eagle", "beagle", "beagle3")}
    uri = f"sqlite:///{root / 'mlflow.db'}"  # one tracking store for the module (each test its own model name)
    MlflowClient(uri).create_experiment("exp", artifact_location=str(root / "artifacts"))
    return root, root / "target", drafts, uri


def register(client, run_config, prepared, draft, key, tau, recipe):
    """What the flow's register stage does, without Prefect: export, register with tags, log the exports."""
    run_id = client.create_run(client.get_experiment_by_name("exp").experiment_id).info.run_id
    exported = stages.export_formats(run_config, prepared, draft, key)
    decision = register_draft(client, run_id=run_id, draft_dir=draft, model_name="drafts", alias="champion",
                              eval_key="e", measures=Measures(tau=tau), taus={"toy": tau}, train_key=key,
                              tags={"specdraft.arch": exported.arch, "specdraft.recipe": recipe,
                                    "specdraft.target": prepared.target})
    log_exports(client, decision["run_id"], exported.exports)
    return exported, decision


def test_exports_are_logged_beside_the_version_and_the_champion_is_served(world, tmp_path):
    root, target, drafts, uri = world
    client = MlflowClient(uri)
    cfg = load(RunConfig, None, [f"workdir={tmp_path / 'work'}", "register.serving.speculative_tokens=4"])
    prepared = Prepared(target=str(target), target_id=target_id(target), prompts=[], wall_s=0.0)

    exported, first = register(client, cfg, prepared, drafts["eagle3"], "k-eagle3", 2.0, "eagle3")
    assert first["promoted"] and sorted(exported.exports) == ["sglang", "speculators"]
    logged = {a.path for a in client.list_artifacts(first["run_id"], "export")}
    assert logged == {"export/sglang", "export/speculators"}
    assert log_exports(client, first["run_id"], exported.exports) == []  # a retried stage logs nothing twice
    assert client.get_model_version("drafts", "1").tags["specdraft.arch"] == "eagle3"

    hass, second = register(client, cfg, prepared, drafts["eagle"], "k-hass", 1.5, "hass")  # worse: not promoted
    assert not second["promoted"] and sorted(hass.exports) == ["eagle", "sglang", "vllm"]
    assert stages.export_formats(cfg, prepared, drafts["eagle"], "k-hass").skipped  # keyed, done once

    champion = champion_exports(client, "drafts", "champion", tmp_path / "served")
    assert champion["version"] == 1 and champion["arch"] == "eagle3" and champion["target"] == str(target)
    assert champion["recipe"] == "eagle3"  # the recipe that trained the champion, not the one just registered
    for fmt, path in champion["exports"].items():  # downloaded from the artifact store, still exact
        assert Path(path).parent == tmp_path / "served" / "v1"
        check_export(path, export_spec(drafts["eagle3"], fmt, target=target, speculative_tokens=4))
    commands = serve_commands(champion["exports"], champion["target"], 4)
    assert champion["exports"]["speculators"] in commands["vllm"] and '"num_speculative_tokens": 4' in commands["vllm"]
    assert "--speculative-algorithm EAGLE3" in commands["sglang"]
    again = champion_exports(client, "drafts", "champion", tmp_path / "served",
                             local={1: {"sglang": "/elsewhere/sglang"}})
    assert again["exports"] == {"sglang": "/elsewhere/sglang"}  # this run's own export: no download

    beagle, third = register(client, cfg, prepared, drafts["beagle"], "k-beagle", 1.0, "beagle")
    assert sorted(beagle.exports) == ["vllm"] and not beagle.note  # served by vLLM through specdraft's plugin
    assert {a.path for a in client.list_artifacts(third["run_id"], "export")} == {"export/vllm"}
    assert third["version"] == 3 and client.get_model_version("drafts", "3").tags["specdraft.arch"] == "beagle"


def test_model_uris_resolve_to_registered_drafts(world, tmp_path):
    root, target, drafts, uri = world
    client = MlflowClient(uri)
    run_id = client.create_run(client.get_experiment_by_name("exp").experiment_id).info.run_id
    register_draft(client, run_id=run_id, draft_dir=drafts["eagle"], model_name="uris", alias="champion",
                   eval_key="e", measures=Measures(tau=1.0), taus={})
    assert resolve_version(client, "models:/uris@champion").version == resolve_version(client, "models:/uris/1").version
    local, version = download_draft(client, "models:/uris@champion", tmp_path / "dl")
    assert sorted(p.name for p in local.iterdir()) == ["config.json", "model.safetensors"]
    for bad in ("runs:/x/draft", "models:/uris", "models:/uris@nobody", "models:/uris/7"):
        with pytest.raises(ValueError):
            resolve_version(client, bad)


def test_export_command(world, tmp_path, capsys):
    root, target, drafts, uri = world
    out = tmp_path / "spec"
    assert main(["export", "--draft", drafts["eagle3"], "--format", "speculators", "--out", str(out),
                 "--target", str(target), "--speculative-tokens", "5", "verifier=org/the-target"]) == 0
    printed = capsys.readouterr().out
    assert f"exported eagle3 draft as speculators: {out}" in printed
    assert f"{vllm_server(str(target))} --host 127.0.0.1" in printed
    spec = json.loads((out / "config.json").read_text())["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 5
    assert spec["verifier"]["name_or_path"] == "org/the-target"
    assert main(["export", "--draft", drafts["eagle3"], "--format", "speculators", "--out", str(out),
                 "--target", str(target), "dtype=float8"]) == 2  # a config error, the export left as it was
    assert "not one of" in capsys.readouterr().err and (out / "model.safetensors").is_file()
    assert main(["export", "--draft", drafts["beagle"], "--format", "sglang", "--out", str(tmp_path / "b"),
                 "--target", str(target)]) == 1
    assert "only vLLM serves Beagle drafts" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    assert main(["export", "--draft", drafts["beagle"], "--format", "vllm", "--out", str(tmp_path / "b"),
                 "--target", str(target)]) == 0
    printed = capsys.readouterr().out
    assert '"method": "eagle"' in printed and "specdraft's plugin" in printed
    assert f"exported beagle draft as vllm: {tmp_path / 'b'}" in printed  # a bare draft: as the engines see it

    client = MlflowClient(uri)  # the champion of a registry, its target found from the version's tag
    run_id = client.create_run(client.get_experiment_by_name("exp").experiment_id).info.run_id
    register_draft(client, run_id=run_id, draft_dir=drafts["eagle"], model_name="m", alias="champion",
                   eval_key="e", measures=Measures(tau=1.0), taus={},
                   tags={"specdraft.target": str(target), "specdraft.recipe": "hass"})
    assert main(["export", "--model-uri", "models:/m@champion", "--tracking-uri", uri, "--format", "eagle",
                 "--out", str(tmp_path / "ref")]) == 0
    printed = capsys.readouterr().out
    assert "models:/m@champion: m v1" in printed and "exported hass draft as eagle" in printed  # not its arch: eagle
    check_export(tmp_path / "ref", export_spec(drafts["eagle"], "eagle", target=target))
    assert main(["export", "--model-uri", "models:/m@nobody", "--tracking-uri", uri, "--format", "eagle",
                 "--out", str(tmp_path / "x")]) == 1

    # issue 44: a beagle3 champion is exported as the beagle3 draft it is (its architecture is beagle); one
    # registered without the recipe tag (before the flow tagged it) is named by the draft as the engines see it
    # issue 40: the serve command's K is the version's fastest in the engine (its eval's sweep, the flow's
    # specdraft.best_k tag) unless --speculative-tokens says another; untagged: the default 3
    for name, tags, k in (("b3", {"specdraft.recipe": "beagle3", "specdraft.best_k": "2"}, 2), ("untagged", {}, 3)):
        run_id = client.create_run(client.get_experiment_by_name("exp").experiment_id).info.run_id
        register_draft(client, run_id=run_id, draft_dir=drafts["beagle3"], model_name=name, alias="champion",
                       eval_key="e", measures=Measures(tau=1.0), taus={}, tags={"specdraft.target": str(target), **tags})
        assert main(["export", "--model-uri", f"models:/{name}@champion", "--tracking-uri", uri,
                     "--out", str(tmp_path / name)]) == 0
        printed = capsys.readouterr().out
        assert f"exported beagle3 draft as vllm: {tmp_path / name}" in printed  # arch: beagle
        assert f'"num_speculative_tokens": {k}' in printed, printed
    assert main(["export", "--model-uri", "models:/b3@champion", "--tracking-uri", uri, "--out", str(tmp_path / "b3k"),
                 "--speculative-tokens", "4"]) == 0
    assert '"num_speculative_tokens": 4' in capsys.readouterr().out

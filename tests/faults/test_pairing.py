"""Faults of class 2, "wrong pairing accepted" (issue 22): a store, draft or regenerate output used
with another target than the one it was made from.

Every artifact records the target's content fingerprint (``specdraft.targets.identity.target_fingerprint``: a
digest of the weights' bytes) and every consumer checks it before its expensive part — train against
its stores, eval against its draft, a resumed dump against the store already there, export — with an
error naming the artifact, its fingerprint and the target's. Real files throughout: a real dump (Ray
Data), a real training run (Ray Train's local mode), the real CLI; the "other" targets are real model
directories (the same weights perturbed, or another shape), and a model updated in place is a real
rewrite of its ``model.safetensors``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from flows.cli import main
from pipelines.dump import dump_features
from pipelines.train import run_training
from specdraft.export import ExportError, export_draft
from specdraft.configs.features import FeaturesConfig
from specdraft.models import read_draft_config
from specdraft.outputs import MARKER
from pipelines.configs import ClusterTrainConfig, ScalingSection
from specdraft.store import read_manifest
from specdraft.configs.reader import ReaderConfig
from specdraft.store.manifest import check_store_target
from specdraft.targets.identity import (
    FINGERPRINT_CACHE,
    TargetMismatch,
    check_pairing,
    layout_id,
    target_fingerprint,
    target_id,
)
from specdraft.toy.conversations import generate_conversations
from specdraft.configs.train import OptimConfig
from tests.tiny_models import NARROW

pytestmark = pytest.mark.slow

CFG = FeaturesConfig(samples_per_shard=8, max_length=96, batch_tokens=400, max_batch_size=6)


def perturbed_copy(src: Path, out: Path) -> Path:
    """``src`` copied to ``out`` with every weight nudged: the same shapes, other weights."""
    shutil.copytree(src, out)
    (out / FINGERPRINT_CACHE).unlink(missing_ok=True)
    rewrite_weights(out)
    return out


def rewrite_weights(target: Path) -> None:
    """Rewrite ``target/model.safetensors`` in place: same tensor names, shapes and file size."""
    file = target / "model.safetensors"
    tensors = load_file(str(file))
    tensors = {k: (v + 0.01 * torch.ones_like(v)) if v.is_floating_point() else v for k, v in tensors.items()}
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def targets(tiny_toy_target, tmp_path_factory) -> dict[str, Path]:
    """The tiny toy target, a copy of it elsewhere, the same shape with other weights, and another shape."""
    root = tmp_path_factory.mktemp("pairing-targets")
    same = root / "copy"
    shutil.copytree(tiny_toy_target, same)
    other = perturbed_copy(tiny_toy_target, root / "other-weights")
    shape = root / "other-shape"  # hidden 32 instead of 64, the toy tokenizer and vocabulary
    config = json.loads((tiny_toy_target / "config.json").read_text())
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(
        **NARROW, vocab_size=config["vocab_size"], max_position_embeddings=config["max_position_embeddings"],
        bos_token_id=config.get("bos_token_id"), eos_token_id=config.get("eos_token_id"),
        pad_token_id=config.get("pad_token_id"), tie_word_embeddings=False,
    ))
    model.save_pretrained(shape)
    for f in tiny_toy_target.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(f, shape / f.name)
    return {"toy": tiny_toy_target, "copy": same, "other": other, "shape": shape}


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return [{"id": f"c{i:03d}", "messages": m} for i, m in enumerate(generate_conversations(24, seed=3))]


@pytest.fixture(scope="module")
def store(local_ray, targets, rows, tmp_path_factory) -> Path:
    """A real dump of the toy target."""
    out = tmp_path_factory.mktemp("pairing-store") / "store"
    dump_features(targets["toy"], rows, out, CFG, progress=False)
    return out


def small_train(**kw) -> ClusterTrainConfig:
    return ClusterTrainConfig(recipe="hass", epochs=[1], seed=0, min_steps=4, checkpoint_every=1000, log_every=1000,
                       sim_depth=2, optim=OptimConfig(lr=1e-3, warmup_steps=1),
                       reader=ReaderConfig(max_tokens=1024, val_fraction=0.2, seed=0),
                       scaling=ScalingSection(num_workers=0), **kw)


@pytest.fixture(scope="module")
def draft(local_ray, targets, store, tmp_path_factory) -> Path:
    """A draft trained on the toy target's store (Ray Train's local mode)."""
    out = tmp_path_factory.mktemp("pairing-train")
    return Path(run_training(small_train(), [store], targets["toy"], out)["draft"])


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pairing-questions") / "q.jsonl"
    convs = generate_conversations(2, 11)
    path.write_text("".join(json.dumps({"question_id": i, "category": "q",
                                        "turns": [m["content"] for m in c if m["role"] == "user"][:1]}) + "\n"
                            for i, c in enumerate(convs)))
    return path


def names_both(message: str, artifact: Path, recorded: str, target: Path) -> bool:
    """The error names the artifact's path and fingerprint and the target's."""
    return (str(artifact) in message and recorded in message and target_fingerprint(target) in message
            and str(target.resolve()) in message)


# --- the fingerprint ----------------------------------------------------------------------------


def test_a_model_updated_in_place_gets_a_new_id_and_fingerprint(targets, tmp_path):
    model = shutil.copytree(targets["toy"], tmp_path / "model")
    before_id, before_fp = target_id(model), target_fingerprint(model)
    assert before_fp.startswith("sha256:") and (model / FINGERPRINT_CACHE).is_file()  # cached beside the model
    rewrite_weights(model)  # same names, shapes and sizes: only the bytes differ
    assert target_id(model) != before_id and target_fingerprint(model) != before_fp


def test_the_same_weights_elsewhere_are_the_same_target_and_other_weights_are_not(targets):
    assert target_fingerprint(targets["copy"]) == target_fingerprint(targets["toy"])
    assert target_fingerprint(targets["other"]) != target_fingerprint(targets["toy"])
    assert layout_id(targets["other"]).split("@")[1] == layout_id(targets["toy"]).split("@")[1]  # what ids were


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_model_directory_caches_its_fingerprint_in_the_user_cache(targets, tmp_path, monkeypatch):
    model = shutil.copytree(targets["toy"], tmp_path / "ro")
    (model / FINGERPRINT_CACHE).unlink(missing_ok=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model.chmod(0o555)
    try:
        assert target_fingerprint(model) == target_fingerprint(targets["toy"])
        assert not (model / FINGERPRINT_CACHE).exists()
        assert len(list((tmp_path / "cache" / "specdraft" / "fingerprints").glob("*.json"))) == 1
    finally:
        model.chmod(0o755)


# --- every artifact records it ----------------------------------------------------------------------


def test_store_and_draft_record_the_target_fingerprint(targets, store, draft):
    fp = target_fingerprint(targets["toy"])
    assert read_manifest(store)["target_fingerprint"] == fp
    config = read_draft_config(draft)
    assert config.target_fingerprint == fp and config.target_id == target_id(targets["toy"])


# --- every consumer checks it, before the expensive part ---------------------------------------------


@pytest.mark.parametrize("which", ["other", "shape"])
def test_train_refuses_a_store_of_another_target_before_ray_trains(targets, store, which, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(TargetMismatch) as err:
        run_training(small_train(), [store], targets[which], out)
    assert names_both(str(err.value), store, read_manifest(store)["target_fingerprint"], targets[which])
    assert not (out / "ray").exists() and not (out / "draft").exists()  # no trainer was started


def test_train_accepts_the_same_weights_in_another_directory(targets, store):
    check_store_target(store, targets["copy"])  # no error: the content decides, not the path


@pytest.mark.parametrize("which", ["other", "shape"])
def test_eval_refuses_a_draft_of_another_target_with_one_line(targets, draft, questions, which, tmp_path, capsys):
    out = tmp_path / "report.json"
    code = main(["eval", "--target", str(targets[which]), "--draft", str(draft), "--questions", str(questions),
                 "--out", str(out), "--quiet", "decode.max_new_tokens=8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and not out.exists()
    assert len(err) == 1 and "wrong target" in err[0], err
    assert names_both(err[0], draft, read_draft_config(draft).target_fingerprint, targets[which])


def files_of(out: Path) -> list[Path]:
    return sorted(p.relative_to(out) for p in out.rglob("*") if p.name != MARKER)


def test_a_resumed_training_run_refuses_another_target_naming_its_checkpoint(targets, draft, rows, tmp_path, capsys):
    """A rerun into a training run's own --out resumes from its checkpoints: with another --target (online
    features: no store to check) it is refused before Ray starts, one line naming the checkpoint and both
    fingerprints — for a killed run (a checkpoint only) and a finished one (its draft)."""
    convs = tmp_path / "convs.jsonl"
    convs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    killed = tmp_path / "killed"  # a killed run's directory: its metrics and its latest checkpoint
    checkpoint = killed / "ray" / "train" / "checkpoint_2026-01-01_00-00-00.000000" / "draft"
    shutil.copytree(draft, checkpoint)
    shutil.copy(draft.parent / "metrics.jsonl", killed / "metrics.jsonl")
    finished = shutil.copytree(draft.parent, tmp_path / "finished", ignore=shutil.ignore_patterns("ray"))
    fingerprint = read_draft_config(draft).target_fingerprint
    for out, named in ((killed, checkpoint), (finished, finished / "draft")):
        before = files_of(out)
        argv = ["train", "--conversations", str(convs), "--target", str(targets["other"]), "--out", str(out),
                "recipe=hass", "epochs=[1]", "min_steps=4", "scaling.num_workers=0"]
        assert main(argv) == 1  # today: trains on, resuming the other target's checkpoint (exit 0)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "wrong target" in err[0], err
        assert names_both(err[0], named, fingerprint, targets["other"]), err[0]
        assert files_of(out) == before  # nothing started, nothing written (but the ownership marker)


def test_eval_with_ray_refuses_on_the_driver(targets, draft, questions):
    from pipelines.evaluate import evaluate

    with pytest.raises(TargetMismatch):
        evaluate(targets["other"], draft, [questions], use_ray=True, progress=False)


def test_dump_refuses_to_resume_a_store_of_another_target(targets, store, rows, tmp_path):
    copy = shutil.copytree(store, tmp_path / "store")
    before = (copy / "manifest.json").read_text()
    with pytest.raises(TargetMismatch) as err:
        dump_features(targets["other"], rows, copy, CFG, progress=False)
    assert names_both(str(err.value), copy, read_manifest(copy)["target_fingerprint"], targets["other"])
    assert (copy / "manifest.json").read_text() == before  # nothing rewritten


def test_a_store_made_before_the_model_was_updated_in_place_is_refused(targets, store, tmp_path):
    model = shutil.copytree(targets["toy"], tmp_path / "model")
    check_store_target(store, model)
    rewrite_weights(model)
    with pytest.raises(TargetMismatch):
        check_store_target(store, model)


def test_export_refuses_a_draft_of_other_weights(targets, draft, tmp_path):
    with pytest.raises(ExportError, match="fingerprint") as err:
        export_draft(draft, "sglang", tmp_path / "out", target=targets["other"])
    assert target_fingerprint(targets["other"]) in str(err.value) and not (tmp_path / "out").exists()
    export_draft(draft, "sglang", tmp_path / "ok", target=targets["copy"])  # the same weights elsewhere


# --- artifacts written before fingerprints ------------------------------------------------------------


def test_an_artifact_written_before_fingerprints_loads_with_one_warning_line(targets, capsys):
    legacy = {"target_id": layout_id(targets["toy"])}  # what a manifest or draft config held then
    check_pairing("old-store", legacy, targets["toy"], what="feature store")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "records no target fingerprint" in err[0] and "old-store" in err[0]
    check_pairing("old-draft", {"target_id": "elsewhere@0123456789abcdef"}, targets["toy"], what="draft")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not verified" in err[0]
    with pytest.raises(TargetMismatch, match="elsewhere@0123456789abcdef"):  # where the id was checked before
        check_pairing("old-draft", {"target_id": "elsewhere@0123456789abcdef"}, targets["toy"], what="draft",
                     legacy_mismatch="error")

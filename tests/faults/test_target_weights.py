"""Issue 31 item 1: a target is its config and its weights. A checkpoint whose ``config.json`` disagrees with its
weights (the shipped 3-layer toy target under a config that says 2 layers) is refused wherever it is loaded —
``specdraft.targets.loading.load_target_model`` loads strictly (``specdraft.targets.checkpoint.check_loading_info``), and dump,
eval, regenerate's HF backend and online training all load through it — and its fingerprint is not that of the
same weights under their own config, so no artifact of one pairs with the other.

Real files: the shipped toy target, a copy of it with an edited ``config.json``, the real CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flows.cli import main
from specdraft.targets.checkpoint import TargetWeightsError
from specdraft.models import build_draft, draft_config_from_target, save_draft
from specdraft.targets.identity import (
    FINGERPRINT_CACHE,
    TargetMismatch,
    check_pairing,
    target_fingerprint,
    target_id,
    target_record,
    weights_fingerprint,
)
from specdraft.targets.loading import load_target_config, load_target_heads, load_target_model
from specdraft.toy.build import PREBUILT_DIR

ROOT = Path(__file__).resolve().parents[2]


def with_layers(src: Path, out: Path, layers: int) -> Path:
    """``src`` copied to ``out`` with a ``config.json`` that says ``layers`` decoder layers (the weights as they are)."""
    shutil.copytree(src, out)
    (out / FINGERPRINT_CACHE).unlink(missing_ok=True)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    if not (PREBUILT_DIR / "model.safetensors").is_file():
        pytest.skip("the shipped toy target is not in this checkout")
    root = tmp_path_factory.mktemp("target-weights")
    true = shutil.copytree(PREBUILT_DIR, root / "true")
    layers = json.loads((true / "config.json").read_text())["num_hidden_layers"]
    return {"true": true, "fewer": with_layers(true, root / "fewer", layers - 1),
            "more": with_layers(true, root / "more", layers + 1)}


def test_a_checkpoint_under_a_config_of_other_depth_is_refused_by_the_loader(targets):
    """Today: the 3-layer weights load as a 2-layer model (the third layer dropped), or a 4-layer one with a
    random layer, and nothing but transformers' table says so."""
    model = load_target_model(targets["true"])  # its own config: loads, strictly
    assert model.config.num_hidden_layers == json.loads((targets["true"] / "config.json").read_text())["num_hidden_layers"]
    for which, words in (("fewer", "in the weights but not in the model"), ("more", "not in the weights")):
        with pytest.raises(TargetWeightsError) as err:
            load_target_model(targets[which])
        line = str(err.value)
        assert "\n" not in line and str(targets[which] / "config.json") in line and words in line, line


def test_eval_refuses_it_with_exit_2_naming_its_config(targets, tmp_path, capsys):
    """The CLI's one line (a ``ConfigError``: exit 2), with a draft made for that very directory (its
    fingerprint matches, so only the strict load can refuse it)."""
    lying = targets["fewer"]
    heads = load_target_heads(lying)
    config = draft_config_from_target(load_target_config(lying), "beagle", **target_record(lying))
    draft = save_draft(build_draft(config, heads.embed, heads.lm_head), tmp_path / "draft")
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 0, "category": "x", "turns": ["What is 2 + 3?"]}) + "\n")
    code = main(["eval", "--target", str(lying), "--draft", str(draft), "--questions", str(questions),
                 "--out", str(tmp_path / "report.json"), "--quiet", "workers=1", "decode.max_new_tokens=4"])
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("specdraft eval")]
    assert code == 2 and len(line) == 1, err[-3000:]
    assert str(lying / "config.json") in line[0] and "Traceback" not in err
    assert not (tmp_path / "report.json").exists()


@pytest.mark.parametrize("command", ["dump", "regenerate", "train"])
def test_the_commands_that_load_it_in_ray_workers_refuse_it_on_the_driver_with_exit_2(targets, command, tmp_path,
                                                                                       capsys):
    """Today: dump, regenerate (hf) and online train load the truncated model in their workers and go on.
    Now the pre-flight builds the model its config describes on the meta device and compares (before Ray)."""
    lying = targets["fewer"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "What is 2 + 3?"},
                                                           {"role": "assistant", "content": "5"}]}) + "\n")
    inputs = {"dump": ["--prompts", str(prompts)], "regenerate": ["--prompts", str(prompts)],
              "train": ["--conversations", str(prompts)]}[command]
    quiet = [] if command == "train" else ["--quiet"]
    code = main([command, "--target", str(lying), "--out", str(tmp_path / "out"), *quiet, *inputs])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and str(lying / "config.json") in lines[0], err[-3000:]
    assert not (tmp_path / "out").exists()


def test_its_fingerprint_is_not_that_of_the_same_weights_under_their_own_config(targets, tmp_path):
    true, lying = targets["true"], targets["fewer"]
    assert weights_fingerprint(lying) == weights_fingerprint(true)  # the same bytes of weights
    assert target_fingerprint(lying) != target_fingerprint(true)  # today: equal (the weights only)
    with pytest.raises(TargetMismatch, match="fingerprint"):
        check_pairing("store", target_record(true), lying, what="feature store")
    with pytest.raises(TargetMismatch):
        check_pairing("store", target_record(lying), true, what="feature store")
    copy = shutil.copytree(true, tmp_path / "copy")
    check_pairing("store", target_record(true), copy, what="feature store")  # both elsewhere: the same target


def test_an_artifact_fingerprinted_before_config_json_counted_still_pairs_by_its_target_id(targets, capsys):
    """A store or draft recorded ``target_fingerprint`` as the weights' digest only; its ``target_id`` (unchanged)
    covered ``config.json``: it pairs silently with its own target and is refused with the other config."""
    true, lying = targets["true"], targets["fewer"]
    earlier = {"target_id": target_id(true), "target_fingerprint": weights_fingerprint(true)}
    check_pairing("old-store", earlier, true, what="feature store")
    assert capsys.readouterr().err == ""
    with pytest.raises(TargetMismatch, match="old-store"):
        check_pairing("old-store", earlier, lying, what="feature store")

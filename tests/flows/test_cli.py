"""The ``specdraft`` command line (flows/cli.py, flows/options.py) and the flow's null tracking run.

Help tables and config parsing are checked without running any job; ``eval`` runs end to end
on the tiny toy target with a random Beagle draft; the flow's stage bodies run with tracking
disabled (a ``NullRun``), outside Prefect (``disable_run_logger``), and leave no MLflow store.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from flows.cli import build_parser, main, parse
from flows.options import command_config
from pipelines.configs import ClusterTrainConfig, DumpConfig, RegenerateConfig, RunConfig
from specdraft.configs.evaluation import EvalSettings
from specdraft.configs.quickstart import QuickstartConfig
from specdraft.configs.toy import ToyTargetConfig
from specdraft.config import flatten
from specdraft.toy.conversations import generate_prompts
from tests.eval_records import check_tau, records_of

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^  (\S+)\s+(.+?)\s{2,}(\S.*)$")  # "  key   type   default"


def help_rows(capsys, command: str) -> dict[str, tuple[str, str]]:
    """``specdraft COMMAND --help`` -> {dotted key: (type, default)} from its config table."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    table = text.split("config fields (", 1)[1].splitlines()
    rows = {m[1]: (m[2], m[3]) for line in table if (m := ROW.match(line))}
    rows.pop("key")  # the header
    return rows


HIDDEN = {"fault.train_fail_at_step",  # test hooks and retired keys, left out of --help (tests/flows/test_help.py)
          "data.regenerate"}  # retired: false is refused, naming regenerate.mode=shipped
# every config-bearing command: (a few nested fields with their type and default, its config class);
# None: not pinned here (other work changes it; the loop below still checks values against the dataclass)
HELP = {
    "eval": ({"decode.gamma": ("int", "5"), "decode.mode": ("chain|tree", "tree"), "max_questions": ("int | None", "null"),
              "ray.replicas": ("int | None", "null")}, EvalSettings),
    "train": ({"optim.lr": ("float", None), "optim.schedule": ("constant|cosine|linear", None),
               "stages[].kind": (None, None), "tracking.enabled": ("bool", "false")}, ClusterTrainConfig),
    "run": ({"eval.settings.decode.gamma": ("int", "5"), "train.optim.lr": ("float", None),
             "tracking.enabled": ("bool", "true")}, RunConfig),
    "dump": ({"hidden_codec": ("fp16|bf16|int8", "fp16")}, DumpConfig),
    "regenerate": ({"ingest.dedup": ("messages|prompts|none", "messages")}, RegenerateConfig),
    "toy-target": ({"max_train_seconds": ("float | None", "null")}, ToyTargetConfig),
    "quickstart": ({"recipe": ("str", "beagle"), "optim.betas": ("tuple[float, float]", "[0.9, 0.95]")},
                   QuickstartConfig),
}


@pytest.mark.parametrize("command", sorted(HELP))
def test_help_lists_every_field_with_its_default(capsys, command):
    expected, root = HELP[command]
    rows = help_rows(capsys, command)
    for key, (type_, default) in expected.items():
        assert key in rows, f"{command} --help misses {key}"
        assert type_ in (None, rows[key][0]) and default in (None, rows[key][1]), (key, rows[key])
    # generated, not hand-listed: every leaf of the dataclass's default tree is there, with its value
    for key, value in flatten(root()).items():
        if key in HIDDEN:
            assert key not in rows, f"{command} --help shows the test hook {key}"
            continue
        assert key in rows, f"{command} --help misses {key}"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert rows[key][1] == json.dumps(value), (key, rows[key], value)


def test_config_errors_exit_2_with_one_line_naming_the_key(capsys, tmp_path):
    out = str(tmp_path / "o")
    eval_args = ["eval", "--target", "t", "--draft", "d", "--questions", "q.jsonl", "--out", str(tmp_path / "r.json")]
    cases = [
        (eval_args + ["decode.gamm=3"], ["decode: unknown key(s) ['gamm']", "'gamma'"]),
        (eval_args + ["decode.gamma=lots"], ["decode.gamma: expected an int, got 'lots'"]),
        (eval_args + ["--mode", "star"], ["decode.mode: 'star' is not one of ['chain', 'tree']"]),
        (["train", "--store", "s", "--target", "t", "--out", out, "bogus=1"],
         ["TrainConfig: unknown key(s) ['bogus']", "'optim'", "'tracking'"]),
        (["train", "--store", "s", "--target", "t", "--out", out, "--recipe", "nope"], ["unknown recipe 'nope'"]),
        (["train", "--target", "t", "--out", out, "features=onlin"], ["features: 'onlin' is not one of"]),
        (["run", "--config", str(tmp_path / "missing.yaml")], ["missing.yaml: cannot read the config file"]),
        (["run", "--config", str(REPO / "configs" / "toy.yaml"), "train.features=online", "train.online.topk=4"],
         ["train.online: specdraft run computes features with its features section",
          "set features.topk instead of train.online.topk"]),
        (["dump", "--target", "t", "--prompts", "p.jsonl", "--out", out, "max_lenght=9"],
         ["DumpConfig: unknown key(s) ['max_lenght']", "'max_length'"]),
    ]
    for argv, needles in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"specdraft {argv[0]}: config error: "), err
        for needle in needles:
            assert needle in err, (needle, err)
    assert main(["train", "--target", "t", "--out", out]) == 2  # neither a store nor conversations
    assert "--conversations" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / "r.json").exists()  # nothing ran


def test_yaml_config_plus_overrides_and_sugar_reach_the_dataclasses(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({"recipe": "hass", "optim": {"lr": 1e-3, "warmup_steps": 5},
                                      "tracking": {"experiment": "mine"}}))
    base = ["train", "--store", "s1", "s2", "--target", "t", "--out", "o", "--config", str(config)]

    cfg, sections = command_config(parse(base + ["optim.lr=2e-4", "epochs=[2]"]))  # hass: one stage
    assert (cfg.recipe, cfg.optim.lr, cfg.optim.warmup_steps, cfg.epochs) == ("hass", 2e-4, 5, [2])
    tracking = sections["tracking"]
    assert (tracking.enabled, tracking.experiment) == (False, "mine")  # train tracks only when asked

    # sugar maps onto the same overrides; an explicit key=value wins; --mlflow gives a trailing k=v back
    args = parse(base + ["--recipe", "eagle", "--mlflow", "recipe=beagle"])
    cfg, sections = command_config(args)
    assert cfg.recipe == "beagle" and args.mlflow == "" and sections["tracking"].enabled
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg, sections = command_config(parse(base + ["--mlflow", uri, "--arch", "eagle"]))
    assert (cfg.arch, sections["tracking"].uri, sections["tracking"].enabled) == ("eagle", uri, True)

    # train --conversations a b k=v: online features from those files (the trailing k=v given back)
    args = parse(["train", "--target", "t", "--out", "o", "--conversations", "c1", "c2", "online.topk=4"])
    cfg, _ = command_config(args)
    assert (cfg.features, cfg.conversations, cfg.online.topk, args.store) == ("online", ["c1", "c2"], 4, [])

    # eval: the decode settings nest under decode., Ray replicas under ray.
    settings, sections = command_config(parse(["eval", "--target", "t", "--draft", "d", "--questions", "q",
                                               "--out", "r", "--mode", "chain", "decode.gamma=3", "ray.replicas=2"]))
    assert (settings.decode.mode, settings.decode.gamma, sections["ray"].replicas) == ("chain", 3, 2)

    # dump/regenerate: --prompts a b k=v gives the trailing k=v back to the overrides
    prompts = tmp_path / "a=b.jsonl"  # an existing file with '=' in its name stays a file
    prompts.write_text("")
    args = parse(["regenerate", "--target", "t", "--prompts", str(prompts), "p2.jsonl", "temperature=0.7",
                  "ingest.max_turns=3", "--out", "o", "seed=4"])
    cfg, _ = command_config(args)
    assert args.prompts == [str(prompts), "p2.jsonl"]
    assert (cfg.temperature, cfg.ingest.max_turns, cfg.seed) == (0.7, 3, 4)

    # run: the default config file is the toy one
    cfg, _ = command_config(parse(["run", "--config", str(REPO / "configs" / "toy.yaml"), "train.recipe=hass",
                                   "train.epochs=[5]"]))
    assert (cfg.name, cfg.train.recipe, cfg.eval.settings.decode.depth) == ("toy", "hass", 5)


def test_the_toy_config_trains_any_recipe_for_its_epochs_in_all():
    """configs/toy.yaml gives the epochs in all (one number), split over the stages of whichever recipe a run
    picks, so ``specdraft run train.recipe=NAME`` works for every recipe without an epoch override."""
    from specdraft.configs.recipes import RECIPES

    for recipe in sorted(RECIPES):
        cfg, _ = command_config(parse(["run", "--config", str(REPO / "configs" / "toy.yaml"), f"train.recipe={recipe}"]))
        stages = cfg.train.resolved()[1]
        assert sum(s.epochs for s in stages) == cfg.train.epochs == 5 and all(s.epochs >= 1 for s in stages), recipe
    cfg, _ = command_config(parse(["run", "--config", str(REPO / "configs" / "toy.yaml")]))
    assert cfg.train.recipe == "beagle3" and cfg.features.aux_layers == "eagle3"  # the default recipe and its features
    assert [s.epochs for s in cfg.train.resolved()[1]] == [3, 2]  # beagle3: earlier stages take the rest


@pytest.fixture(scope="module")
def tiny_draft(tiny_toy_target, tmp_path_factory) -> Path:
    """A random Beagle draft sharing the tiny toy target's embedding and lm_head."""
    import torch

    from specdraft.models import build_draft, draft_config_from_target, save_draft
    from specdraft.targets.loading import load_target_config, load_target_heads

    torch.manual_seed(0)
    heads = load_target_heads(tiny_toy_target)
    draft = build_draft(draft_config_from_target(load_target_config(tiny_toy_target), "beagle"), heads.embed,
                        heads.lm_head)
    return save_draft(draft, tmp_path_factory.mktemp("draft") / "beagle")


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("questions") / "toy.jsonl"
    path.write_text("".join(
        json.dumps({"question_id": i, "category": "toy", "turns": [m["content"] for m in c if m["role"] == "user"]})
        + "\n" for i, c in enumerate(generate_prompts(3, seed=5))))
    return path


def test_eval_end_to_end_through_the_cli(tiny_toy_target, tiny_draft, questions, tmp_path, capsys):
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump({"decode": {"gamma": 3, "max_new_tokens": 24}, "max_questions": 2,
                                      "warmup": False}))
    out = tmp_path / "report.json"
    argv = ["eval", "--target", str(tiny_toy_target), "--draft", str(tiny_draft), "--questions", str(questions),
            "--out", str(out), "--quiet", "--config", str(config), "--mode", "chain", "decode.max_new_tokens=10"]
    assert main(argv) == 0
    assert f"report: {out}" in capsys.readouterr().out
    report = json.loads(out.read_text())
    decode = report["settings"]["decode"]
    assert (decode["mode"], decode["gamma"], decode["max_new_tokens"]) == ("chain", 3, 10)
    assert report["settings"]["max_questions"] == 2
    block = report["datasets"]["toy"]
    assert block["lossless_checked"] == block["num_turns"] >= 2 and block["lossless_mismatches"] == 0
    check_tau(block, records_of(report, "toy"))
    assert len(block["alpha"]) == 3


def test_flow_stages_run_on_a_null_tracking_run(tiny_toy_target, tiny_draft, questions, tmp_path, monkeypatch):
    from prefect.logging import disable_run_logger

    from flows.regenerate_and_train import eval_stage, open_parent_run, prepare_stage, register_stage
    from pipelines.records import Trained
    from pipelines.configs import RunConfig
    from pipelines.tracking import NullRun
    from specdraft.config import load, to_dict

    monkeypatch.chdir(tmp_path)  # an MLflow run opened by mistake would leave mlflow.db / mlruns here
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load(RunConfig, REPO / "configs" / "toy.yaml", [
        "tracking.enabled=false", f"workdir={tmp_path / 'work'}", f"target.path={tiny_toy_target}",
        f"data.prompts=[{questions}]", f"eval.questions=[{questions}]", "eval.settings.max_questions=1",
        "eval.settings.warmup=false", "eval.settings.decode.max_new_tokens=8"])
    data = to_dict(cfg)
    parent, tr = open_parent_run(cfg)
    assert isinstance(parent, NullRun) and parent.run_id is None and not parent.enabled
    trained = Trained(key="random-beagle", draft=str(tiny_draft), metrics={}, metrics_file="", wall_s=0.0)
    with disable_run_logger():  # the stage bodies, outside a Prefect flow
        prepared = prepare_stage(data, tr)
        evaluated = eval_stage(data, tr, prepared, trained)
        registered = register_stage(data, tr, prepared, trained, evaluated)
    parent.set_tags({"target_id": prepared.target_id})
    parent.close()
    assert prepared.target == str(tiny_toy_target.resolve())
    report = json.loads(Path(evaluated.report).read_text())
    assert evaluated.tau == {name: check_tau(block, records_of(report, name))
                             for name, block in report["datasets"].items()} != {}
    assert evaluated.mean_tau == sum(evaluated.tau.values()) / len(evaluated.tau) and evaluated.lossless_mismatches == 0
    assert (registered.registered, registered.reason, registered.wall_s) == (False, "tracking disabled", 0.0)
    assert registered.version is None  # nothing for `specdraft run` to print
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_online_train_stage_logs_the_config_it_trains_with(tmp_path, monkeypatch):
    """With online features the train stage's MLflow run gets the run's ``features`` section as ``train.online``
    and the regenerated conversations: the values the worker trains with and logs again into the same run."""
    from mlflow.tracking import MlflowClient
    from prefect.logging import disable_run_logger

    from flows.regenerate_and_train import open_parent_run, train_stage
    from pipelines import stages
    from pipelines.configs import core_features
    from pipelines.records import Prepared, Regenerated, Trained
    from specdraft.config import load, to_dict

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load(RunConfig, REPO / "configs" / "toy.yaml", [
        "train.features=online", "features.topk=4", "features.max_length=80", f"workdir={tmp_path / 'work'}",
        f"tracking.uri={uri}", "tracking.experiment=online-params"])
    seen = {}

    def train(cfg, prepared, stores, tracking=None, fail_at_step=None):  # the worker, without Ray
        seen["cfg"] = stages.train_config(cfg, stores)
        return Trained(key="k", draft="d", metrics={}, metrics_file=str(tmp_path / "none.jsonl"), wall_s=0.0)

    monkeypatch.setattr(stages, "train", train)
    parent, tr = open_parent_run(cfg)
    regenerated = [Regenerated(key="r", prompt="p.jsonl", conversations=str(tmp_path / "r"), summary={}, wall_s=0.0)]
    with disable_run_logger():
        train_stage(to_dict(cfg), tr, Prepared(target="t", target_id="i", prompts=[], wall_s=0.0), regenerated)
    parent.close()
    client = MlflowClient(uri)
    (child,) = client.search_runs([client.get_experiment_by_name("online-params").experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent.run_id}'")
    params = child.data.params
    assert (params["train.online.topk"], params["train.online.max_length"]) == ("4", "80")
    # the run's features, less the dump's actors (pipelines.configs.DumpConfig): the workers compute them
    assert params["train.conversations"] == str([str(tmp_path / "r")]) and seen["cfg"].online == core_features(cfg.features)


def test_aux_layers_overrides_for_dump_and_run():
    base = ["dump", "--target", "T", "--prompts", "p.jsonl", "--out", "o"]
    assert command_config(parse(base + ["aux_layers=eagle3"]))[0].aux_layers == "eagle3"
    assert command_config(parse(base + ["aux_layers=2,4,5"]))[0].aux_layers == [2, 4, 5]
    assert command_config(parse(base))[0].aux_layers is None
    assert command_config(parse(["run", "features.aux_layers=eagle3"]))[0].features.aux_layers == "eagle3"
    assert main(base + ["aux_layers=eagle"]) == 2  # neither eagle3 nor a list of layers


def test_every_out_directory_is_checked_before_its_command_runs():
    """Each command writing an --out directory is in ``OUTPUTS`` (checked in ``main`` before it runs) or
    checks it itself (export: ``export_draft``), and offers --overwrite where a foreign non-empty directory can
    be written into (docs/guarantees.md); `specdraft run` checks its workdir in its pre-flight."""
    from flows.cli import OUTPUTS

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, command in sub.choices.items():
        options = {opt for action in command._actions for opt in action.option_strings}
        if "--out" not in options:
            continue
        assert name in OUTPUTS or name == "export", name
        assert ("--overwrite" in options) == (name != "eval"), name
        for option in OUTPUTS.get(name, ((), ()))[0]:
            assert f"--{option}" in options, (name, option)  # an input the check reads

"""Fault injection, issue 22 classes 5 and 6: a bad configuration fails before the expensive part, one
weights-loading path refuses pickles, and the local Ray cluster listens on 127.0.0.1 only.

Each bad input runs the ``specdraft`` command line (``flows.cli.main``; once in a subprocess, as a user runs
it) and must exit 2 with one line naming the key, before Ray, Prefect or a model started (nothing written to
``--out``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdraft.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def specdraft(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The command line in a subprocess, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "flows.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


class Ran:
    """What ``flows.cli.main`` did in this process (subprocesses cost a minute each on a loaded CI machine)."""

    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture()
def cli(capsys, monkeypatch):
    from flows.cli import main

    monkeypatch.chdir(ROOT)

    def run(*argv: str) -> Ran:
        code = main(list(argv))
        out = capsys.readouterr()
        return Ran(code, out.out, out.err)

    return run


def refused(result, *words: str) -> str:
    """The one line a refused command printed (exit 2), after checking it names ``words`` and nothing started."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-3000:])
    assert len(lines) == 1 and "config error" in lines[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Ray" not in result.stdout + result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def no_tokenizer_target(prebuilt, tmp_path_factory) -> Path:
    """The toy target with its weights and config but no tokenizer files."""
    out = tmp_path_factory.mktemp("no-tokenizer") / "target"
    shutil.copytree(prebuilt, out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (out / name).unlink(missing_ok=True)
    return out


@pytest.fixture(scope="module")
def pickle_target(prebuilt, tmp_path_factory) -> Path:
    """The toy target with its weights as a pickle (``pytorch_model.bin``) instead of safetensors."""
    from safetensors.torch import load_file

    out = tmp_path_factory.mktemp("pickle") / "target"
    shutil.copytree(prebuilt, out)
    torch.save(load_file(out / "model.safetensors"), out / "pytorch_model.bin")
    (out / "model.safetensors").unlink()
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A prompt file, a question file and a draft-looking directory (the refusals come before they are read)."""
    d = tmp_path_factory.mktemp("inputs")
    (d / "prompts.jsonl").write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n')
    (d / "questions.jsonl").write_text('{"question_id": 0, "category": "x", "turns": ["hi"]}\n')
    (d / "draft").mkdir()
    (d / "draft" / "config.json").write_text("{}")
    (d / "draft" / "model.safetensors").write_bytes(b"")
    (d / "store").mkdir()
    return d


def test_a_wrong_epoch_count_for_the_recipe_exits_2_before_ray(prebuilt, inputs, tmp_path):
    """The real command line, in a subprocess: exit status 2 and one line."""
    result = specdraft("train", "--store", str(inputs / "store"), "--target", str(prebuilt), "--out",
                       str(tmp_path / "out"), "--recipe", "hass", "epochs=[4,1]")
    refused(result, "epochs", "hass")
    assert not (tmp_path / "out").exists()


def test_decode_gamma_0_exits_2_before_a_model_loads(cli, prebuilt, inputs, tmp_path):
    result = cli("eval", "--target", str(prebuilt), "--draft", str(inputs / "draft"), "--questions",
                       str(inputs / "questions.jsonl"), "--out", str(tmp_path / "report.json"), "--mode", "chain",
                       "decode.gamma=0")
    refused(result, "gamma")
    assert not (tmp_path / "report.json").exists()


def test_aux_layers_the_target_lacks_exit_2_before_it_loads(cli, tiny_toy_target, inputs, tmp_path):
    """``aux_layers=eagle3`` on a 2-layer target (three distinct layers below its last do not exist), or a layer
    index past its depth: one line naming the key, for ``dump`` and for ``specdraft run``'s features."""
    for aux, words in (("eagle3", ("aux_layers", "N=2")), ("[0,5]", ("aux_layers",))):
        refused(cli("dump", "--target", str(tiny_toy_target), "--prompts", str(inputs / "prompts.jsonl"),
                    "--out", str(tmp_path / "out"), f"aux_layers={aux}"), *words)
    refused(cli("run", "--config", str(ROOT / "configs" / "toy.yaml"), f"target.path={tiny_toy_target}",
                f"data.prompts=[{inputs / 'prompts.jsonl'}]", f"workdir={tmp_path / 'work'}"), "features.aux_layers", "N=2")
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


def test_a_target_config_that_does_not_parse_exits_2_naming_it(cli, prebuilt, inputs, tmp_path):
    broken = tmp_path / "target"
    shutil.copytree(prebuilt, broken)
    (broken / "config.json").write_text("{not json")
    line = refused(cli("dump", "--target", str(broken), "--prompts", str(inputs / "prompts.jsonl"), "--out",
                       str(tmp_path / "out"), "aux_layers=eagle3"), "config.json")
    assert str(broken) in line and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["dump", "regenerate", "eval", "train"])
def test_a_target_without_tokenizer_files_exits_2_naming_it(cli, command, no_tokenizer_target, inputs, tmp_path):
    common = ["--target", str(no_tokenizer_target), "--out", str(tmp_path / "out")]
    argv = {"dump": ["--prompts", str(inputs / "prompts.jsonl")],
            "regenerate": ["--prompts", str(inputs / "prompts.jsonl")],
            "eval": ["--draft", str(inputs / "draft"), "--questions", str(inputs / "questions.jsonl")],
            "train": ["--conversations", str(inputs / "prompts.jsonl")]}[command]
    line = refused(cli(command, *common, *argv), "--target", "no tokenizer files")
    assert "sentencepiece" not in line
    assert not (tmp_path / "out").exists()


def test_specdraft_run_refuses_bad_config_before_prefect_or_ray(cli, no_tokenizer_target):
    refused(cli("run", "train.recipe=hass", "train.epochs=[4,1]"), "train", "epochs")
    refused(cli("run", "eval.settings.decode.gamma=0"), "gamma")
    refused(cli("run", f"target.path={no_tokenizer_target}"), "target.path", "no tokenizer files")
    refused(cli("run", "train.epochs=[0,0]"), "epochs", "no stage trains")
    refused(cli("run", "train.epochs=1"), "epochs=1", "a total of 1 cannot give each of the 2 stage(s)")


def draft_dir(root: Path, arch: str | None, weights: bool = True) -> Path:
    """A directory that looks like a draft of ``arch`` to the pre-flight (its files' names and config.json)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text("{}" if arch is None else f'{{"arch": "{arch}"}}')
    if weights:
        (root / "model.safetensors").write_bytes(b"")
    return root


def test_run_settings_that_fail_only_after_the_expensive_stages_are_refused_first(cli, tmp_path, monkeypatch):
    """Issue 44: ``eval.questions=[]`` and a typo in ``train.init_from`` failed after regenerate, dump and train."""
    from flows.preflight import check_run
    from pipelines.configs import RunConfig
    from specdraft.config import load

    monkeypatch.chdir(ROOT)
    arch = load(RunConfig, "configs/toy.yaml", []).train.resolved()[0]
    other = "eagle" if arch != "eagle" else "beagle"
    refused(cli("run", "eval.questions=[]"), "eval.questions", "no question file")
    refused(cli("run", "train.init_from=champoin"), "train.init_from=champoin", "no such directory", "champion")
    refused(cli("run", f"train.init_from={draft_dir(tmp_path / 'other', other)}"), "train.init_from",
            f"a {other} draft", f"a {arch} draft")
    refused(cli("run", f"train.init_from={draft_dir(tmp_path / 'bare', arch, weights=False)}"), "train.init_from",
            "not a draft directory", "model.safetensors")
    refused(cli("run", f"train.init_from={draft_dir(tmp_path / 'old', None)}"), "train.init_from",
            "names no draft architecture")

    def run(*overrides: str) -> None:
        check_run(load(RunConfig, "configs/toy.yaml", [f"workdir={tmp_path / 'w'}", *overrides]))

    run()  # from scratch
    run("train.init_from=champion")  # the registered one, resolved when the run trains (none yet: from scratch)
    run(f"train.init_from={draft_dir(tmp_path / 'mine', arch)}")
    run("eval.questions=[configs/data/toy_questions.jsonl,configs/data/toy_questions.jsonl]")


def test_train_refuses_a_store_given_twice_and_an_init_from_it_cannot_load(cli, prebuilt, inputs, tmp_path):
    from specdraft.outputs import repeated_paths

    store, out = inputs / "store", str(tmp_path / "out")
    refused(cli("train", "--store", str(store), str(store), "--target", str(prebuilt), "--out", out), "--store",
            "given twice")
    refused(cli("train", "--store", str(store), f"{store}/../store/", "--target", str(prebuilt), "--out", out),
            f"the same store as {store}")
    refused(cli("train", "--store", str(store), "--target", str(prebuilt), "--out", out, "init_from=champion"),
            "init_from=champion", "only `specdraft run`")
    refused(cli("train", "--store", str(store), "--target", str(prebuilt), "--out", out, f"init_from={tmp_path}/x"),
            "init_from=", "no such directory")
    assert not (tmp_path / "out").exists()
    assert repeated_paths([store, inputs / "draft", "s3://b/x", "s3://b/x/"]) == [("s3://b/x", "s3://b/x/")]
    assert repeated_paths([store, inputs / "draft"]) == []


def test_actors_holding_every_cpu_of_the_local_cluster_are_refused(cli, monkeypatch):
    """A dump actor asking Ray for all of a local cluster's CPUs leaves Ray Data's tasks beside it none: the stage
    waited forever (configs/smollm2.yaml, ray.num_cpus=2). Refused before Ray starts. Regenerate's replicas (hf,
    vllm) run with no task beside them."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    refused(cli("run", "ray.num_cpus=2", "features.cpus_per_actor=2"), "features.cpus_per_actor=2", "all 2 CPUs")
    refused(cli("run", "ray.num_cpus=4", "features.num_actors=2", "features.cpus_per_actor=2"), "num_actors=2")
    from flows.preflight import check_cluster_cpus
    from pipelines.configs import RunConfig
    from specdraft.config import from_dict

    def config(**sections) -> RunConfig:
        return from_dict(RunConfig, {"ray": {"num_cpus": 2}, **sections})

    check_cluster_cpus(config(features={"cpus_per_actor": 1, "torch_threads": 2}))  # the smollm2 config's way
    for backend in ("hf", "vllm"):  # replicas only, no tasks beside them
        check_cluster_cpus(config(regenerate={"backend": backend, "num_cpus": 2}))
    check_cluster_cpus(from_dict(RunConfig, {"ray": {"address": "auto"}, "features": {"cpus_per_actor": 64}}))


def test_the_flow_never_retries_a_config_error(no_tokenizer_target):
    """Every stage task's retry condition refuses a ConfigError (the same on every try) and retries the rest;
    the flow itself checks the config and paths before any stage (``.fn``: its body, without the engine)."""
    from prefect.states import Failed

    from flows import regenerate_and_train as flow

    task = flow._task(flow.train_stage, retries=2)
    assert task.retries == 2 and task.retry_condition_fn is flow.retry_unless_config_error
    assert not flow.retry_unless_config_error(task, None, Failed(data=ConfigError("train: epochs=[4, 1]")))
    assert flow.retry_unless_config_error(task, None, Failed(data=RuntimeError("a worker died")))
    with pytest.raises(ConfigError, match="target.path"):
        flow.regenerate_and_train.fn(config=str(ROOT / "configs/toy.yaml"),
                                     overrides=[f"target.path={no_tokenizer_target}"])


def test_every_command_refuses_a_pickle_target(cli, pickle_target, inputs, tmp_path):
    """One weights-loading path (safetensors only): the loader itself and every command's pre-flight."""
    from specdraft.targets.loading import load_target_model

    with pytest.raises(OSError, match="safetensors"):
        load_target_model(pickle_target)
    for command, argv in {"eval": ["--draft", str(inputs / "draft"), "--questions", str(inputs / "questions.jsonl")],
                          "dump": ["--prompts", str(inputs / "prompts.jsonl")],
                          "regenerate": ["--prompts", str(inputs / "prompts.jsonl")]}.items():
        refused(cli(command, "--target", str(pickle_target), "--out", str(tmp_path / command), *argv),
                "--target", "pickle", "pytorch_model.bin")


LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def test_the_local_ray_cluster_listens_on_127_0_0_1_only(local_ray):
    """Every socket the local cluster's processes (GCS, raylets, agents, workers) listen on is a loopback one."""
    psutil = pytest.importorskip("psutil")
    session = Path(local_ray._private.worker._global_node.get_session_dir_path()).name
    assert local_ray._private.worker._global_node.node_ip_address == "127.0.0.1"
    pids = {p.pid for p in psutil.Process().children(recursive=True)}
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(session in arg for arg in p.info["cmdline"] or ()):
                pids.add(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    try:
        listening = [c for c in psutil.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.pid in pids]
    except psutil.AccessDenied:
        pytest.skip("reading the machine's sockets needs more rights here")
    names = {c.pid: psutil.Process(c.pid).name() for c in listening}
    assert len(listening) >= 3, listening  # GCS, raylet, agents at least
    exposed = [(names[c.pid], c.laddr.ip, c.laddr.port) for c in listening if c.laddr.ip not in LOOPBACK]
    assert not exposed, exposed

"""Class 1 of issue 22, "Data destroyed", and class 6's readable exports: faults against every ``--out``.

Through the real CLI on real files: a non-empty ``--out`` is refused (exit 2, one line naming the
directory and ``--overwrite``) unless it is that command's own earlier output; an ``--out`` that is,
is inside or holds an input is refused even with ``--overwrite``, naming both; ``--overwrite``
replaces only what the command writes; what is written is readable by another user (0755 / 0644)
under any umask. A real dump into a foreign directory, then its rerun, checks that the ownership
marker keeps resume working (``specdraft/outputs.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from flows.cli import main
from specdraft import files
from specdraft.models import save_draft
from specdraft.outputs import MARKER, OutputError, check_output, mark_output
from tests.specdraft.decoding.decoding_helpers import tiny_draft, tiny_target


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones too) -> sha256: what must survive untouched."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def user_dir(path: Path) -> Path:
    """A directory a user filled by hand: a file, a private file and a sub-directory."""
    (path / "notes").mkdir(parents=True)
    (path / "results.csv").write_text("run,tau\na,3.1\n")
    (path / "notes" / "todo.md").write_text("keep me\n")
    (path / ".private").write_text("secret\n")
    os.chmod(path / ".private", 0o600)
    return path


def modes(root: Path) -> set[tuple[str, str]]:
    """(kind, octal permission) of ``root`` and everything under it."""
    out = {("dir", oct(stat.S_IMODE(root.stat().st_mode)))}
    for p in root.rglob("*"):
        out.add(("dir" if p.is_dir() else "file", oct(stat.S_IMODE(p.stat().st_mode))))
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A saved random target and an EAGLE-3 draft of it, side by side under one directory."""
    root = tmp_path_factory.mktemp("outputs")
    target = tiny_target(num_hidden_layers=4, max_position_embeddings=4096)
    target.save_pretrained(root / "models" / "target")
    draft = save_draft(tiny_draft(target, "eagle3"), root / "models" / "drafts" / "eagle3")
    return root, root / "models" / "target", draft


def export_argv(target: Path, draft: Path, out: Path, *extra: str) -> list[str]:
    return ["export", "--draft", str(draft), "--format", "speculators", "--target", str(target), "--out", str(out),
            *extra]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


# --------------------------------------------------------------------------- export


def test_export_refuses_a_non_empty_directory_and_leaves_it_as_it_was(world, tmp_path, capsys):
    root, target, draft = world
    out = user_dir(tmp_path / "mine")
    before = snapshot(out)
    assert main(export_argv(target, draft, out)) == 2  # today: exit 0, and the directory's files are gone
    err = one_line_error(capsys)
    assert str(out) in err and "--overwrite" in err
    assert snapshot(out) == before and not (out / "model.safetensors").exists()


@pytest.mark.parametrize("where", ["draft", "parent of the draft", "grandparent of the draft", "inside the draft",
                                   "target", "inside the target"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_export_never_writes_over_its_draft_or_target(world, where, overwrite, capsys):
    root, target, draft = world
    out = {"draft": draft, "parent of the draft": draft.parent, "grandparent of the draft": draft.parent.parent,
           "inside the draft": draft / "served", "target": target, "inside the target": target / "spec"}[where]
    before = snapshot(root)
    argv = export_argv(target, draft, out, *(["--overwrite"] if overwrite else []))
    assert main(argv) == 2  # today: exit 0 and the draft (or the directory holding it) replaced by the export
    err = one_line_error(capsys)
    named = target if "target" in where else draft
    assert str(out) in err and str(named) in err, err
    assert snapshot(root) == before and not (draft / "served").exists() and not (target / "spec").exists()


def test_overwrite_replaces_only_the_exports_own_files(world, tmp_path, capsys):
    root, target, draft = world
    out = user_dir(tmp_path / "served")
    (out / "config.json").write_text("{}")  # a name the export writes: that one is replaced
    theirs = {k: v for k, v in snapshot(out).items() if k != "config.json"}
    assert main(export_argv(target, draft, out, "--overwrite")) == 0  # today: the user's files are deleted
    assert {k: v for k, v in snapshot(out).items() if k in theirs} == theirs
    assert stat.S_IMODE((out / ".private").stat().st_mode) == 0o600  # the user's file exactly as it was
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "eagle3"
    assert (out / "model.safetensors").is_file()

    # its own output now: a rerun replaces the export again, no --overwrite needed, the user's files still there
    capsys.readouterr()
    assert main(export_argv(target, draft, out, "--speculative-tokens", "5")) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert {k: v for k, v in snapshot(out).items() if k in theirs} == theirs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served"]  # no temporary left


def test_exports_drafts_and_toy_builds_are_readable_under_a_private_umask(world, tmp_path, capsys):
    """An engine running as another user reads the export: dirs 0755, files 0644 whatever the umask."""
    root, target, draft = world
    readable = {("dir", "0o755"), ("file", "0o644")}
    old = os.umask(0o077)
    try:
        assert main(export_argv(target, draft, tmp_path / "spec")) == 0
        saved = save_draft(tiny_draft(tiny_target(num_hidden_layers=4), "eagle"), tmp_path / "draft")
        with files.write_directory(tmp_path / "any" / "dir") as tmp:
            (tmp / "sub").mkdir()
            (tmp / "sub" / "f.bin").write_bytes(b"x")
        written = files.write_text(tmp_path / "single.json", "{}")
        from specdraft.toy.build import build_toy_target
        from specdraft.configs.toy import ToyTargetConfig

        toy = build_toy_target(tmp_path / "toy", ToyTargetConfig(), progress=False, prebuilt=True)
    finally:
        os.umask(old)
    for out in (tmp_path / "spec", saved, tmp_path / "any" / "dir", toy):  # today: 0o700 / 0o600
        assert modes(out) == readable, (out, modes(out))
    assert oct(stat.S_IMODE(written.stat().st_mode)) == "0o644"


# --------------------------------------------------------------------------- every command, before it runs


@pytest.fixture
def inputs(tmp_path):
    """Input files of every command, each where a careless --out could point: prompts in a data dir, a
    store dir, a questions file."""
    data = tmp_path / "data"
    data.mkdir()
    convs = data / "convs.jsonl"
    convs.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": "hello"}]}) + "\n")
    store = tmp_path / "stores" / "s1"
    store.mkdir(parents=True)
    (store / "manifest.json").write_text("{}")
    questions = data / "questions.jsonl"
    questions.write_text(json.dumps({"question_id": 0, "category": "toy", "turns": ["hi"]}) + "\n")
    return {"data": data, "convs": convs, "store": store, "questions": questions}


def test_no_command_writes_over_its_input(world, inputs, tmp_path, capsys):
    root, target, draft = world
    i = inputs
    cases = [  # (argv, the input that must be named)
        (["dump", "--target", str(target), "--prompts", str(i["convs"]), "--out", str(target), "--overwrite"], target),
        (["dump", "--target", str(target), "--prompts", str(i["convs"]), "--out", str(i["data"])], i["convs"]),
        (["regenerate", "--target", str(target), "--prompts", str(i["data"]), "--out", str(i["data"] / "answers"),
          "--overwrite"], i["data"]),
        (["regenerate", "--target", str(target), "--prompts", str(i["convs"]), "--out", str(root)], target),
        (["train", "--store", str(i["store"]), "--target", str(target), "--out", str(i["store"]), "--overwrite"],
         i["store"]),
        (["train", "--store", str(i["store"]), "--target", str(target), "--out", str(i["store"].parent)], i["store"]),
        (["train", "--conversations", str(i["convs"]), "--target", str(target), "--out", str(i["data"])], i["convs"]),
        (["train", "--target", str(target), "--out", str(i["data"]), "features=online",
          f"conversations={json.dumps([str(i['convs'])])}"], i["convs"]),  # given as a config key
        (["eval", "--target", str(target), "--draft", str(draft), "--questions", str(i["questions"]),
          "--out", str(i["questions"])], i["questions"]),
        (["eval", "--target", str(target), "--draft", str(draft), "--questions", str(i["questions"]),
          "--out", str(draft / "report.json")], draft),
    ]
    before = snapshot(tmp_path), snapshot(root)
    for argv, named in cases:
        assert main(argv) == 2, argv  # today: each starts its work (Ray, models) on its own input
        err = one_line_error(capsys)
        out = argv[argv.index("--out") + 1]
        assert err.startswith(f"specdraft {argv[0]}: --out {out}") and str(named) in err, (argv, err)
    assert (snapshot(tmp_path), snapshot(root)) == before


def test_a_non_empty_directory_is_refused_unless_overwrite(world, inputs, tmp_path, capsys):
    root, target, draft = world
    out = user_dir(tmp_path / "mine")
    before = snapshot(out)
    argvs = [
        ["dump", "--target", str(target), "--prompts", str(inputs["convs"])],
        ["regenerate", "--target", str(target), "--prompts", str(inputs["convs"])],
        ["train", "--store", str(inputs["store"]), "--target", str(target)],
        ["toy-data", "--prompts", "2", "--questions", "1"],
        ["quickstart", "--quiet"],
    ]
    for argv in argvs:
        assert main([*argv, "--out", str(out)]) == 2, argv  # today: each writes among (or over) the user's files
        err = one_line_error(capsys)
        assert str(out) in err and "--overwrite" in err and f"`specdraft {argv[0]}`" in err, err
    assert snapshot(out) == before

    # --overwrite: toy-data writes its two files beside the user's and owns the directory from then on
    assert main(["toy-data", "--prompts", "2", "--questions", "1", "--out", str(out), "--overwrite"]) == 0
    assert {k: v for k, v in snapshot(out).items() if k in before} == before
    assert (out / "toy_prompts.jsonl").is_file() and json.loads((out / MARKER).read_text()) == {"command": "toy-data"}
    assert main(["toy-data", "--prompts", "3", "--questions", "1", "--out", str(out)]) == 0  # its own: a rerun
    capsys.readouterr()
    assert main(["dump", "--target", str(target), "--prompts", str(inputs["convs"]), "--out", str(out)]) == 2
    assert "is the output of `specdraft toy-data`" in one_line_error(capsys)  # another command's output


def test_own_earlier_output_is_recognised(tmp_path):
    """A rerun's directory: the command's marker, or (written before markers) the files only it writes."""
    out = tmp_path / "run"
    mark_output(out, "train")
    (out / "metrics.jsonl").write_text("")
    assert check_output(out, "train") is True
    with pytest.raises(OutputError, match="is the output of `specdraft train`"):
        check_output(out, "regenerate")
    old = tmp_path / "old-store"  # a store dumped before the marker existed
    (old / "shard-00000.zarr").mkdir(parents=True)
    assert check_output(old, "dump", own=("manifest.json", "shard-*")) is True
    assert check_output(tmp_path / "absent", "dump") is False and not (tmp_path / "absent").exists()
    with pytest.raises(OutputError, match="is a file"):
        check_output(out / MARKER, "dump")


@pytest.mark.slow  # one real dump on Ray, then its rerun
def test_dump_into_a_foreign_directory_with_overwrite_then_resume(local_ray, tiny_toy_target, tmp_path, capsys):
    from tests.pipelines.test_dump import conversations

    prompts = tmp_path / "convs.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in conversations(6)[:6]))
    out = user_dir(tmp_path / "store")
    theirs = snapshot(out)
    argv = ["dump", "--target", str(tiny_toy_target), "--prompts", str(prompts), "--out", str(out), "--quiet",
            "samples_per_shard=3", "max_length=96"]
    assert main(argv) == 2
    capsys.readouterr()
    assert main([*argv, "--overwrite"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["rows_out"] == 6 and first["shards_written"] == 2
    assert {k: v for k, v in snapshot(out).items() if k in theirs} == theirs  # the user's files kept
    assert main(["validate-store", str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert main(argv) == 0  # its own store now: the rerun resumes (nothing to redo), no --overwrite needed
    again = json.loads(capsys.readouterr().out)
    assert (again["shards_kept"], again["shards_written"], again["rows_out"]) == (2, 0, 6)


# --------------------------------------------------------------------------- toy-target and run's workdir


def test_toy_target_into_a_foreign_directory_is_refused_unless_overwrite(tmp_path, capsys):
    """toy-target's --out is checked like every other command's: refused with one line (exit 2), written beside
    the user's files with --overwrite, its own from then on."""
    from specdraft.toy.build import is_complete_build

    out = user_dir(tmp_path / "mine")
    before = snapshot(out)
    argv = ["toy-target", "--prebuilt", "--quiet", "--out", str(out)]
    assert main(argv) == 2  # today: exit 1, a FileExistsError traceback, and no --overwrite to pass
    err = one_line_error(capsys)
    assert str(out) in err and "--overwrite" in err and "`specdraft toy-target`" in err, err
    assert snapshot(out) == before

    assert main([*argv, "--overwrite"]) == 0
    assert {k: v for k, v in snapshot(out).items() if k in before} == before  # the user's files kept
    assert stat.S_IMODE((out / ".private").stat().st_mode) == 0o600
    assert is_complete_build(out) and json.loads((out / MARKER).read_text()) == {"command": "toy-target"}
    assert main(argv) == 0  # its own build now: no --overwrite needed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temporary left
    capsys.readouterr()
    assert main(["toy-data", "--out", str(out)]) == 2  # another command's output
    assert "is the output of `specdraft toy-target`" in one_line_error(capsys)


def run_argv(workdir: Path, inputs: dict, *extra: str) -> list[str]:
    return ["run", "--config", "configs/toy.yaml", f"workdir={workdir}", "tracking.enabled=false", "target.path=",
            f"data.prompts=[{inputs['convs']}]", f"eval.questions=[{inputs['questions']}]", *extra]


def test_run_refuses_a_foreign_workdir_and_one_holding_its_inputs(inputs, tmp_path, capsys):
    """`specdraft run`'s workdir is its --out: a non-empty one that is not a run's is refused unless --overwrite,
    one that is, is inside or holds an input even with it — one line, exit 2, before Prefect or Ray starts."""
    foreign = user_dir(tmp_path / "mine")
    before = snapshot(tmp_path)
    assert main(run_argv(foreign, inputs)) == 2  # today: the run writes its stages among the user's files
    err = one_line_error(capsys)
    assert err.startswith(f"specdraft run: workdir={foreign} is not empty") and "--overwrite" in err, err
    cases = [  # (workdir, the input named)
        (inputs["data"], inputs["convs"]),  # holds the prompts (and the questions)
        (tmp_path, inputs["convs"]),
        (inputs["data"] / "runs", inputs["data"]),  # inside a prompt directory: its outputs would be read back
    ]
    for workdir, named in cases:
        prompts = inputs["data"] if workdir == inputs["data"] / "runs" else inputs["convs"]
        argv = run_argv(workdir, {**inputs, "convs": prompts}, "--overwrite")
        assert main(argv) == 2, argv
        err = one_line_error(capsys)
        assert err.startswith(f"specdraft run: workdir={workdir} ") and str(named) in err, (workdir, err)
    assert snapshot(tmp_path) == before and not (inputs["data"] / "runs").exists()


def test_a_run_workdir_is_the_runs_own_after_overwrite_or_an_earlier_run(inputs, world, tmp_path):
    """The checks of the CLI and of the flow itself (a deployment has no --overwrite): --overwrite marks the
    directory, the flow then finds it the run's own; a workdir of a run from before the marker is known by
    its stage directories; a workdir equal to or holding target.path is refused."""
    from flows.preflight import check_workdir
    from pipelines.configs import RunConfig
    from specdraft.config import load

    def cfg(workdir, target=""):
        return load(RunConfig, None, [f"workdir={workdir}", f"target.path={target}", f"data.prompts=[{inputs['convs']}]"])

    foreign = user_dir(tmp_path / "mine")
    with pytest.raises(OutputError, match="--overwrite"):
        check_workdir(cfg(foreign))
    check_workdir(cfg(foreign), overwrite=True)
    mark_output(foreign, "run")  # as `specdraft run --overwrite` does before the flow starts
    check_workdir(cfg(foreign))
    legacy = tmp_path / "legacy"
    (legacy / "regenerate" / "abc").mkdir(parents=True)
    check_workdir(cfg(legacy))
    root, target, draft = world
    for workdir in (target, root):
        with pytest.raises(OutputError, match=f"the input target.path {target}"):
            check_workdir(cfg(workdir, target), overwrite=True)


def test_run_refuses_a_hand_off_directory_it_did_not_write(inputs, tmp_path, capsys):
    """``handoff.exports`` naming a user's directory holding current/ and previous/ (issue 44 item 5): `specdraft
    run` refuses it in one line, exit 2, before any work, and leaves it untouched; with ``handoff.enabled=false``
    the directory is not the run's business and not checked."""
    from flows.preflight import check_run
    from pipelines.configs import RunConfig
    from specdraft.config import load

    users = tmp_path / "served"
    for name in ("current", "previous"):
        user_dir(users / name)
    before = snapshot(users)
    assert main(run_argv(tmp_path / "runs", inputs, f"handoff.exports={users}")) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"specdraft run: handoff.exports={users} is not empty") and "not a hand-off" in err, err
    assert snapshot(users) == before and not (tmp_path / "runs").exists()
    argv = [f"workdir={tmp_path / 'runs'}", "target.path=", f"data.prompts=[{inputs['convs']}]",
            f"eval.questions=[{inputs['questions']}]", f"handoff.exports={users}"]
    check_run(load(RunConfig, None, [*argv, "handoff.enabled=false"]))
    with pytest.raises(OutputError, match="not a hand-off directory"):
        check_run(load(RunConfig, None, argv))
    check_run(load(RunConfig, None, [*argv[:-1], f"handoff.exports={tmp_path / 'new'}"]))
    assert snapshot(users) == before and not (tmp_path / "new").exists()

"""Issue 31 item 9 (its parts here): errors that name their cause, with the exit code the README promises.
A corrupt Parquet prompt file is one line naming the file (exit 2), not a pyarrow traceback; a size setting of 0
names its key (``samples_per_shard``), not "sizes must be >= 1"; ``export`` refuses a pickle target with exit 2
like every other command. The real CLI, real files."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from flows.cli import main
from tests.faults.test_outputs import export_argv, world  # noqa: F401 - world: the module fixture


def one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith(f"specdraft {command}")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


@pytest.mark.parametrize("damage", ["cut short", "bytes flipped"])
@pytest.mark.parametrize("command", ["dump", "regenerate"])
def test_a_corrupt_parquet_prompt_file_is_one_line_naming_it(prebuilt, command, damage, tmp_path, capsys):
    """Today: a pyarrow traceback ("Parquet magic bytes not found", "Corrupt snappy compressed data") naming no file."""
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"prompt": [f"What is {i} + {i}?" for i in range(200)]}), good)
    data = good.read_bytes()
    bad = tmp_path / "prompts.parquet"
    bad.write_bytes(data[: len(data) // 2] if damage == "cut short"
                    else data[:64] + bytes(b ^ 0xFF for b in data[64:400]) + data[400:])
    code = main([command, "--target", str(prebuilt), "--prompts", str(bad), "--out", str(tmp_path / "out"), "--quiet"])
    line = one_line(capsys, command)
    assert code == 2 and str(bad) in line and "Parquet" in line, line


def test_samples_per_shard_0_names_its_key(prebuilt, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n')
    code = main(["dump", "--target", str(prebuilt), "--prompts", str(prompts), "--out", str(tmp_path / "out"),
                 "samples_per_shard=0"])
    line = one_line(capsys, "dump")
    assert code == 2 and "samples_per_shard=0" in line and "must be >= 1" in line, line  # today: "sizes must be >= 1"
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_pickle_target_with_exit_2(world, tmp_path, capsys):  # noqa: F811
    """Today: exit 1 ("cannot export: no *.safetensors"), where every other command exits 2."""
    from safetensors.torch import load_file

    root, target, draft = world
    pickled = shutil.copytree(target, tmp_path / "target")
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    code = main(export_argv(pickled, draft, tmp_path / "out"))
    line = one_line(capsys, "export")
    assert code == 2 and "pickle" in line and "pytorch_model.bin" in line and str(pickled) in line, line
    assert not (tmp_path / "out").exists()

"""`specdraft import-target` refuses what it cannot convert with one line and exit 2, before reading any weight
(issue 32 item 1; the real conversion of SmolLM2 is in tests/flows/test_real_model.py)."""

from __future__ import annotations

import numpy as np
import pytest

from flows.cli import main

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'specdraft[real]')")


def write_gguf(path, arch: str) -> None:
    """A tiny valid GGUF file of architecture ``arch`` (one small tensor), written with the gguf package."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def refusal(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_an_architecture_it_cannot_convert_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "mamba")
    line = refusal(capsys, ["import-target", "--gguf", str(path), "--out", str(tmp_path / "out")])
    assert "architecture 'mamba' cannot be converted" in line and "llama" in line
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_not_gguf_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf file")
    line = refusal(capsys, ["import-target", "--gguf", str(path), "--out", str(tmp_path / "out")])
    assert "is not a GGUF file" in line
    assert not (tmp_path / "out").exists()


def test_a_package_that_is_not_installed_or_holds_no_gguf_is_one_line_exit_2(tmp_path, capsys):
    line = refusal(capsys, ["import-target", "--package", "no-such-package-here", "--out", str(tmp_path / "a")])
    assert "'no-such-package-here' is not installed" in line
    line = refusal(capsys, ["import-target", "--package", "pyyaml", "--out", str(tmp_path / "b")])
    assert "holds no .gguf files" in line


def test_the_gguf_files_own_directory_is_not_an_output(tmp_path, capsys):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama")
    line = refusal(capsys, ["import-target", "--gguf", str(path), "--out", str(tmp_path)])
    assert "input" in line and "--gguf" in line

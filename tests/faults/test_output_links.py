"""Issue 31 item 4: an ``--out`` that is a symlink (say to a mounted serving volume). ``export --overwrite`` used to
replace the link with a directory — the export did not land where the link points — and left a hidden temporary
symlink beside it. ``specdraft.files.write_directory`` (every whole-directory writer: exports, drafts, toy
targets) now writes where the link points and keeps the link. The real CLI, a real export."""

from __future__ import annotations

import os

from flows.cli import main
from tests.faults.test_outputs import export_argv, snapshot, world  # noqa: F401 - world: the module fixture


def test_export_overwrite_into_a_symlinked_out_lands_where_the_link_points(world, tmp_path, capsys):  # noqa: F811
    root, target, draft = world
    volume = tmp_path / "volume" / "serving"
    volume.mkdir(parents=True)
    (volume / "README.txt").write_text("the serving volume\n")  # the user's file: kept
    link = tmp_path / "out"
    link.symlink_to(volume, target_is_directory=True)
    assert main(export_argv(target, draft, link, "--overwrite")) == 0, capsys.readouterr().err
    assert main(export_argv(target, draft, link, "--overwrite")) == 0, capsys.readouterr().err  # a rerun replaces it
    assert link.is_symlink() and os.readlink(link) == str(volume)  # today: a directory replaced the link
    assert {"config.json", "model.safetensors", "README.txt"} <= set(os.listdir(volume))
    assert (volume / "README.txt").read_text() == "the serving volume\n"
    assert sorted(os.listdir(tmp_path)) == ["out", "volume"]  # today: also a hidden ".out.tmp-..." symlink
    assert sorted(os.listdir(volume.parent)) == ["serving"]
    assert snapshot(link) == snapshot(volume)
